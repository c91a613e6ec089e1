"""``atoll bootstrap``: a light DHT peer that an organisation hosts for the swarm to meet at.

A bootstrap peer runs atoll's DHT (:class:`~atoll.dht.kad.AtollDHT`, server mode, under
``/atoll/kad/1.0.0``) on a bare Noise-only libp2p host
(:func:`~atoll.node.net.host.open_libp2p_host`) and nothing else: no model, no torch, no
GPU, no run of its own. It belongs to no run (``run_id=None``): it stores and serves the
records of every run, each checked by the same rules as everywhere (seal, signer, key,
expiry; :mod:`atoll.dht.records`), with atoll's Ed25519 envelopes
(:mod:`atoll.node.envelopes`), and it publishes none. Peers of any run that know its
address join the DHT through it and find each other.

What an operator gets (the answers to what users of other peer systems complain about):

- a fixed address: the identity is a key file (``~/.atoll/bootstrap.key`` by default)
  created mode 0600 on first start and loaded after, so the peer id, and with a fixed
  port the whole multiaddr, survive restarts;
- one process per identity: :class:`~atoll.security.identity.IdentityLock` refuses a
  second process with the same key file at once, naming the file and the holder's pid;
- the address to hand out, printed (``bootstrap: /ip4/.../tcp/.../p2p/12D3KooW...``,
  one line per address, wildcards such as ``0.0.0.0`` expanded to the interfaces' own)
  and optionally written to a file, replaced atomically, once the DHT serves;
- a clean stop: SIGINT (Ctrl+C) or SIGTERM closes every connection and listener, bounded
  (about 5 s), and the process exits with status 0.

A private run's bootstrap (``--run MANIFEST --cert CERT``, the manifest's
``[membership]`` private) serves that run's members only. It runs the run's atoll host
(:func:`~atoll.node.net.host.open_host`) so that a peer proves its membership in the Hello
exchange (nodes connect to their join addresses that way), and serves a DHT stream only to
a peer whose Hello passed (:meth:`~atoll.node.net.host.AtollHost.wait_admitted`, which
waits for a Hello in progress on the same connection): anyone else's is reset, with one
WARNING line per peer. Every record it stores or serves must come from
a member (:class:`~atoll.node.envelopes.EnvelopeVerifier` with the run's membership). It is
itself a member: on the allowlist, or with a certificate of its own (nodes check the
bootstrap's Hello as it checks theirs). Messages sent to it are dropped.

Start-up failures (a bad multiaddr, a port in use, an unusable key file, the identity in
use) raise :class:`~atoll.protocol.errors.ConfigError` with a one-line message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.host.basic_host import BasicHost

from atoll.dht.kad import DHT_PROTOCOL, AtollDHT
from atoll.dht.status import serve_status
from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier, SystemClock
from atoll.node.net.dialback import serve_dialback
from atoll.node.net.host import AtollHost, HostConfig, expand_wildcard, open_host, open_libp2p_host
from atoll.node.settings import BootstrapConfig, check_own_membership, load_membership
from atoll.protocol.errors import ConfigError, unwrap_lone
from atoll.protocol.manifest import RunManifest
from atoll.security.identity import Identity, IdentityLock, load_or_create

__all__ = ["dialable_addrs", "run", "write_addr_file"]

logger = logging.getLogger(__name__)

_STATUS_EVERY_S = 600.0  # how often the routing table's size is logged (INFO)


def run(cfg: BootstrapConfig, *, on_ready: Callable[[Sequence[str]], None]) -> str:
    """Serve the DHT as ``cfg`` says until SIGINT or SIGTERM; return that signal's name.

    Takes the identity's lock, loads (or creates) the identity, starts the host and the
    DHT, writes ``cfg.addr_file`` if set, then calls ``on_ready`` with the peer's full
    multiaddrs. The signals are caught only while this runs (a signal during start-up
    stops it too); a second SIGINT while shutting down raises ``KeyboardInterrupt``.

    Raises :class:`~atoll.protocol.errors.ConfigError` (one line) when it cannot start:
    an address that is not a multiaddr, or that cannot be listened on; a key file that
    cannot be used; :class:`~atoll.security.identity.IdentityInUse` when another process
    runs with the identity.
    """
    listen = cfg.listen_addrs()
    for addr in listen:
        try:
            multiaddr.Multiaddr(addr)
        except Exception as e:  # multiaddr raises a zoo of types on bad text
            raise ConfigError(
                f"--listen {addr!r} is not a multiaddr like /ip4/0.0.0.0/tcp/4001: {e}"
            ) from None
    path = Path(cfg.identity).expanduser()
    with IdentityLock(path):
        identity = load_or_create(path)
        if cfg.run:  # a private run's bootstrap must be a member itself; say so now
            manifest = RunManifest.load(Path(cfg.run).expanduser())
            policy, certificate = load_membership(manifest, cfg.cert)
            if policy is None or not policy.private:
                raise ConfigError(
                    f"--run {cfg.run}: the run is public; a public swarm's bootstrap serves "
                    "every run, start it without --run"
                )
            check_own_membership(manifest, identity.peer_id, certificate)
        host_config = HostConfig(
            listen=listen, dial_timeout_s=cfg.timeout_s, hello_timeout_s=cfg.timeout_s
        )
        try:
            return trio.run(_serve, cfg, identity, host_config, on_ready)
        except OSError as e:  # bind: address in use, not available, permission denied
            raise ConfigError(f"cannot listen on {', '.join(listen)}: {e.strerror or e}") from None


async def _serve(
    cfg: BootstrapConfig,
    identity: Identity,
    host_config: HostConfig,
    on_ready: Callable[[Sequence[str]], None],
) -> str:
    """The trio side of :func:`run`: serve until a signal cancels it."""
    caught: list[str] = []
    # a start-up failure (a port in use, say) comes out of the nursery wrapped; a lone one
    # is handed back as it was raised, for its one-line message
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        unwrap_lone(keep_grouped=(trio.Cancelled,)),
    ):
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    caught.append(signal.Signals(signum).name)
                    logger.info("%s: stopping the bootstrap peer", caught[0])
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            await _serve_dht(cfg, identity, host_config, on_ready)
    # without a signal, _serve_dht never returns; a signal cancelled it
    return caught[0] if caught else "end"


async def _serve_dht(
    cfg: BootstrapConfig,
    identity: Identity,
    host_config: HostConfig,
    on_ready: Callable[[Sequence[str]], None],
) -> None:
    if cfg.run:
        await _serve_private(cfg, identity, host_config, on_ready)
        return
    async with (
        open_libp2p_host(identity, host_config) as host,
        # the DHT's stream handler goes on before anyone can connect (see atoll.dht.kad)
        AtollDHT.start(
            host,
            run_id=None,
            verifier=EnvelopeVerifier(),
            signer=EnvelopeSigner(identity),
            clock=SystemClock(),
            timeout_s=cfg.timeout_s,
        ) as dht,
    ):
        serve_status(host, dht.value_store)
        serve_dialback(host, wall=time.time)
        addrs = dialable_addrs(host)
        if cfg.addr_file:
            write_addr_file(Path(cfg.addr_file).expanduser(), addrs)
        logger.info("bootstrap peer %s serving the DHT at %s", dht.peer_id, ", ".join(addrs))
        on_ready(addrs)
        while True:
            await trio.sleep(_STATUS_EVERY_S)
            logger.info(
                "bootstrap peer %s: %d DHT servers in the routing table",
                dht.peer_id,
                len(dht.routing_table_peers()),
            )


async def _serve_private(
    cfg: BootstrapConfig,
    identity: Identity,
    host_config: HostConfig,
    on_ready: Callable[[Sequence[str]], None],
) -> None:
    """:func:`_serve_dht` for one private run: members only (module docstring)."""
    manifest = RunManifest.load(Path(cfg.run).expanduser())
    policy, certificate = load_membership(manifest, cfg.cert)
    run_id = manifest.run_id()
    async with (
        open_host(
            identity, run_id, host_config, membership=policy, certificate=certificate
        ) as atoll,
        AtollDHT.start(
            atoll.libp2p_host,
            run_id=run_id,
            verifier=EnvelopeVerifier(policy),
            signer=EnvelopeSigner(identity, certificate),
            clock=SystemClock(),
            timeout_s=cfg.timeout_s,
        ) as dht,
        trio.open_nursery() as nursery,
    ):
        _members_only(atoll)
        serve_status(atoll.libp2p_host, dht.value_store)
        serve_dialback(atoll.libp2p_host, wall=time.time)
        nursery.start_soon(_drop_messages, atoll)
        addrs = dialable_addrs(atoll.libp2p_host)
        if cfg.addr_file:
            write_addr_file(Path(cfg.addr_file).expanduser(), addrs)
        logger.info(
            "bootstrap peer %s serving the members of run %s at %s",
            dht.peer_id,
            run_id[:12],
            ", ".join(addrs),
        )
        on_ready(addrs)
        await trio.sleep_forever()


def _members_only(atoll: AtollHost) -> None:
    """Put a gate before the DHT's stream handler: only admitted peers are served."""
    host = atoll.libp2p_host
    handlers = host.get_mux().handlers
    handler = handlers.get(DHT_PROTOCOL)
    if handler is None:  # the DHT must have set it; never serve it ungated
        raise RuntimeError(f"no {DHT_PROTOCOL} handler to put the membership gate before")
    warned: set[str] = set()

    async def gated(stream: INetStream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        if await atoll.wait_admitted(peer):
            await handler(stream)
            return
        if peer not in warned:
            warned.add(peer)
            logger.warning(
                "refused a DHT stream from peer %s: it has not shown this private run's "
                "membership in a Hello",
                peer,
            )
        with contextlib.suppress(Exception):
            await stream.reset()

    host.set_stream_handler(DHT_PROTOCOL, gated)


async def _drop_messages(atoll: AtollHost) -> None:
    """Read and drop what peers send: a bootstrap takes part in no round."""
    while True:
        peer, msg = await atoll.receive()
        logger.debug("dropped %s from peer %s", type(msg).__name__, peer)


def dialable_addrs(host: BasicHost) -> list[str]:
    """The multiaddrs other peers can dial this host at, each ending in ``/p2p/<id>``.

    What the listeners are bound to (with the port the OS picked for port 0), a wildcard
    address (``0.0.0.0``, ``::``) replaced by this machine's interface addresses; no
    address a peer merely observed. Order kept, duplicates dropped.
    """
    peer = f"/p2p/{host.get_id()}"
    out: list[str] = []
    for addr in host.get_transport_addrs():
        for concrete in expand_wildcard(addr):
            text = str(concrete) + peer
            if text not in out:
                out.append(text)
    return out


def write_addr_file(path: Path, addrs: Sequence[str]) -> None:
    """Write ``addrs``, one per line, to ``path``: a temporary file in the same directory,
    flushed to disk, then renamed over ``path``, so a reader sees the old file or the
    whole new one, never a part. Raises ``ConfigError`` when it cannot."""
    text = "".join(f"{a}\n" for a in addrs).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(text)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"cannot write the address file {path}: {e.strerror or e}") from None
