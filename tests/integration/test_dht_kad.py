"""atoll's DHT (atoll.dht.kad) between real processes on 127.0.0.1 (port 0).

Run as a script, this file is one DHT node in a process of its own::

    python tests/integration/test_dht_kad.py node --run RUN --seed HEX
        [--bootstrap ADDR] [--peer-record] [--ready FRAGMENT:SLOT] [--rpc-timeout-s S]
        [--store-bounds TOTAL,PER_PEER,FAIR_SHARE]
    python tests/integration/test_dht_kad.py foreign

``node`` runs atoll's Noise-only host with an :class:`~atoll.dht.kad.AtollDHT` on it,
prints ``LISTENING <multiaddr>``, bootstraps from ``ADDR``, publishes its PeerRecord
and/or announces its ReadyRecord, prints one JSON line with the timings, then answers
JSON commands read from stdin, one line each (see :func:`_command`), until stdin EOF.
``foreign`` is a plain py-libp2p ``KadDHT`` server speaking /ipfs/kad/1.0.0: a peer of
another network. Records are sealed with atoll.security.signing (Ed25519 envelopes).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.routing_table import RoutingTable
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError
from libp2p.records.record import make_signed_put_record
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from atoll.dht.kad import DHT_PROTOCOL, AtollDHT, _KadHost
from atoll.dht.keys import peer_key, ready_key, ready_topic
from atoll.dht.records import (
    AttestationRecord,
    PeerRecord,
    ReadyRecord,
    Record,
    RejectedRecord,
    encode_value,
)
from atoll.dht.storebound import StoreBounds
from atoll.node.net.host import HostConfig, open_host
from atoll.protocol.certificate import Attestation, assemble, seal_attestation
from atoll.protocol.errors import ConfigError
from atoll.protocol.liveness import Liveness
from atoll.protocol.messages import decode_message, encode_message
from atoll.security.identity import Identity, generate
from atoll.security.signing import SignedEnvelope, open_envelope, seal, signer_peer_id

pytestmark = pytest.mark.integration

RUN = "d47a" * 16
HERE = Path(__file__).resolve()
START_TIMEOUT_S = 60  # a cold start imports libp2p on a busy 2-core machine
COMMAND_TIMEOUT_S = 40  # one command; the DHT's own bound is DHT_TIMEOUT_S (2x for find_ready)
DHT_TIMEOUT_S = 10.0
IPFS_KAD = "/ipfs/kad/1.0.0"
log = logging.getLogger("atoll.tests.dht")


# -- the test seal: atoll's Ed25519 envelopes -------------------------------------------------
class EnvelopeSigner:
    def __init__(self, identity: Identity) -> None:
        self._identity = identity

    def seal(self, domain: str, payload: bytes) -> bytes:
        return seal(self._identity, domain, payload).to_bytes()


class EnvelopeVerifier:
    def open(self, data: bytes, *, domain: str, max_payload: int) -> tuple[bytes, str]:
        env = SignedEnvelope.from_bytes(data, max_bytes=max_payload + 1024)
        return open_envelope(env, domain=domain, max_payload=max_payload), signer_peer_id(env)


@dataclass
class ShiftedClock:
    """Wall time plus ``offset`` seconds: a node whose clock runs ahead, set by command."""

    offset: float = 0.0

    def wall(self) -> float:
        return time.time() + self.offset


def peer_record(peer_id: str, addrs: tuple[str, ...], now: float, ttl: float = 300) -> PeerRecord:
    return PeerRecord(peer_id, RUN, addrs, "atoll-test/0", 0.0, (), (), False, now, now + ttl)


def ready_record(peer_id: str, fragment: int, slot: int, now: float) -> ReadyRecord:
    return ReadyRecord(RUN, fragment, slot, peer_id, 1, "00" * 32, 1.0, now, now, now + 300)


FLOOD_FRAGMENT = 1  # the ready records of a flood are for this fragment, slots 0, 1, ...
FLOOD_TOPIC_FRAGMENT = 2  # the ready topics a provider flood announces


# -- the node (this file run as a script) -----------------------------------------------------
async def _node(args: argparse.Namespace) -> None:
    identity = Identity.from_private_bytes(bytes.fromhex(args.seed))
    clock = ShiftedClock()
    config = HostConfig(dial_timeout_s=5, hello_timeout_s=5)
    bounds = None
    if args.store_bounds:
        bounds = StoreBounds(*(int(x) for x in args.store_bounds.split(",")))
    async with open_host(identity, args.run, config) as atoll_host:
        host = atoll_host.libp2p_host
        async with AtollDHT.start(
            host,
            run_id=args.run,
            verifier=EnvelopeVerifier(),
            signer=EnvelopeSigner(identity),
            clock=clock,
            timeout_s=DHT_TIMEOUT_S,
            rpc_timeout_s=args.rpc_timeout_s,
            store_bounds=bounds,
        ) as dht:
            print(f"LISTENING {atoll_host.addrs[0]}", flush=True)
            started: dict[str, Any] = {}
            if args.bootstrap:
                t0 = time.perf_counter()
                started["answered"] = await dht.bootstrap([args.bootstrap])
                started["bootstrap_s"] = time.perf_counter() - t0
            if args.peer_record:
                t0 = time.perf_counter()
                await dht.put(peer_record(dht.peer_id, tuple(atoll_host.addrs), clock.wall()))
                started["put_s"] = time.perf_counter() - t0
            if args.ready:
                fragment, slot = (int(x) for x in args.ready.split(":"))
                t0 = time.perf_counter()
                await dht.announce_ready(ready_record(dht.peer_id, fragment, slot, clock.wall()))
                started["announce_s"] = time.perf_counter() - t0
            started["table"] = dht.routing_table_peers()
            print(json.dumps(started), flush=True)
            signer = EnvelopeSigner(identity)
            await _serve_commands(lambda cmd: _command(dht, clock, host, cmd, signer))


async def _command(
    dht: AtollDHT,
    clock: ShiftedClock,
    host: BasicHost,
    cmd: dict[str, Any],
    signer: EnvelopeSigner | None = None,
) -> Any:
    """One command of the tests; ``AtollDHT`` internals are poked only to play a broken or
    hostile peer (store_raw, inject, flood, flood_providers) or to look inside (has,
    protocols, usage)."""
    op = cmd["op"]
    kad = dht._kad
    if op == "get":
        record = await dht.get(cmd["key"])
        return {"record": None if record is None else encode_message(record).hex()}
    if op == "find_ready":
        records = await dht.find_ready(cmd["fragment"], cmd["slot"])
        return {"records": [encode_message(r).hex() for r in records]}
    if op == "find_peers":
        peers = await dht.find_peers()
        return {"records": [encode_message(r).hex() for r in peers]}
    if op == "announce_peer":  # any record: announce_peer must refuse all but its own PeerRecord
        await dht.announce_peer(decode_message(bytes.fromhex(cmd["record"])))
        return {}
    if op == "put":
        record = decode_message(bytes.fromhex(cmd["record"]))
        assert isinstance(record, PeerRecord | ReadyRecord)
        await dht.put(record)
        return {}
    if op == "announce_ready":
        now = clock.wall()
        await dht.announce_ready(ready_record(dht.peer_id, cmd["fragment"], cmd["slot"], now))
        return {}
    if op == "announce_attestation":  # this node attests (fragment, version, digest)
        assert signer is not None
        attestation = Attestation(
            RUN, cmd["fragment"], cmd["version"], cmd["digest"], "0" * 32, tuple(cmd["members"])
        )
        now = clock.wall()
        record = AttestationRecord(
            dht.peer_id,
            RUN,
            attestation.fragment,
            attestation.version,
            attestation.digest,
            seal_attestation(attestation, signer),
            now,
            now + 300,
        )
        await dht.announce_attestation(record)
        return {}
    if op == "find_attestations":
        records = await dht.find_attestations(cmd["fragment"], cmd["version"])
        return {"records": [encode_message(r).hex() for r in records]}
    if op == "liveness":  # what this node's DHT learned of one peer, on its trio clock
        now = trio.current_time()
        heard = dht.liveness.heard_at(cmd["peer"])
        return {
            "suspected": dht.liveness.suspected(cmd["peer"], now),
            "silent": dht.liveness.silent(cmd["peer"]),
            "heard_ago": None if heard is None else now - heard,
            "suspects": dht.liveness.suspects(now),
        }
    if op == "table":
        return {"peers": dht.routing_table_peers()}
    if op == "lookup":  # a lookup of a random key: asks every connected peer when few are known
        with trio.fail_after(DHT_TIMEOUT_S):
            found = await kad.peer_routing.find_closest_peers_network(os.urandom(32))
        return {"found": [str(p) for p in found]}
    if op == "store_raw":  # send a value to one peer as is, skipping this node's validator
        key = cmd["key"].encode()
        value = bytes.fromhex(cmd["value"])
        signed = make_signed_put_record(key, value, host.get_private_key())
        with trio.fail_after(DHT_TIMEOUT_S):
            ok = await kad.value_store._store_at_peer(
                ID.from_base58(cmd["peer"]), key, value, record=signed
            )
        return {"stored": ok}
    if op == "inject":  # hold a value unvalidated: a server that skips the validator
        kad.value_store.put(cmd["key"].encode(), bytes.fromhex(cmd["value"]))
        return {}
    if op == "has":
        return {"has": kad.value_store.get(cmd["key"].encode()) is not None}
    if op == "flood":  # store ready records at one peer: this node's own, or fresh signers'
        return await _flood(kad, ID.from_base58(cmd["peer"]), cmd["slots"], cmd["signers"], signer)
    if op == "flood_providers":  # announce this node for many ready topics at one peer
        peer = ID.from_base58(cmd["peer"])
        for slot in range(cmd["topics"]):
            topic = ready_topic(RUN, FLOOD_TOPIC_FRAGMENT, slot).encode()
            with trio.fail_after(DHT_TIMEOUT_S):
                await kad.provider_store._send_add_provider(peer, topic)
        return {}
    if op == "usage":  # what peers hold in this node's stores, by its ledgers and in fact
        usage = dht.store_usage()
        own = "/" + dht.peer_id
        values = [
            k for k in kad.value_store.store if not k.decode("utf-8", "replace").endswith(own)
        ]
        entries = [p for held in kad.provider_store.providers.values() for p in held]
        return {
            "values": usage.values,
            "providers": usage.providers,
            "by_signer": usage.values_by_signer,
            "by_provider": usage.providers_by_peer,
            "store_values": len(values),
            "store_providers": len([p for p in entries if p != dht.peer_id]),
        }
    if op == "clock":
        clock.offset = float(cmd["offset"])
        return {}
    if op == "protocols":  # what identify told this host about a peer
        try:
            return {"protocols": host.get_peerstore().get_protocols(ID.from_base58(cmd["peer"]))}
        except PeerStoreError:
            return {"protocols": []}
    raise ValueError(f"unknown op {op!r}")


async def _flood(
    kad: KadDHT, peer: ID, slots: int, signers: int, own: EnvelopeSigner | None
) -> dict[str, Any]:
    """Store ready records for slots ``0 .. slots - 1`` of :data:`FLOOD_FRAGMENT` at
    ``peer``, one PUT_VALUE each (the library's one-peer store): this node's own records
    when ``signers`` is 0, else those of ``signers`` fresh identities, one after another.
    Returns how many were sent and how many ``peer`` took."""
    assert own is not None
    sealers: list[tuple[str, EnvelopeSigner]] = []
    if signers == 0:
        sealers.append((str(kad.local_peer_id), own))
    for _ in range(signers):
        identity = generate()
        sealers.append((identity.peer_id, EnvelopeSigner(identity)))
    sent = stored = 0
    for peer_id, signer in sealers:
        for slot in range(slots):
            record = ready_record(peer_id, FLOOD_FRAGMENT, slot, time.time())
            value = encode_value(record, signer)
            with trio.fail_after(DHT_TIMEOUT_S):
                ok = await kad.value_store._store_at_peer(peer, record.key().encode(), value)
            sent += 1
            stored += bool(ok)
    return {"sent": sent, "stored": stored}


async def _serve_commands(run: Any) -> None:
    """Read JSON commands from stdin, one per line; answer each with one JSON line (with
    the seconds it took, or the error it raised). Returns on stdin EOF."""
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
        buf = b""
        while True:
            data = await stdin.receive_some()
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                t0 = time.perf_counter()
                try:
                    out = await run(json.loads(line))
                except Exception as e:
                    log.info("command %s failed: %r", line[:80], e)
                    out = {"error": type(e).__name__, "message": str(e)}
                    if isinstance(e, RejectedRecord):
                        out["rule"] = e.rule
                out["s"] = time.perf_counter() - t0
                print(json.dumps(out), flush=True)


async def _foreign() -> None:
    """A plain py-libp2p KadDHT server (/ipfs/kad/1.0.0) on a Noise-only host."""
    kp = create_new_key_pair()
    noise = NoiseTransport(kp, noise_privkey=create_new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=kp,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
    )
    assert isinstance(host, BasicHost)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        dht = KadDHT(host, DHTMode.SERVER)
        async with background_trio_service(dht):
            print(f"LISTENING {host.get_addrs()[0]}", flush=True)
            print(json.dumps({}), flush=True)
            await _serve_commands(lambda cmd: _foreign_command(dht, host, cmd))
        with trio.CancelScope(shield=True):
            await host.close()


async def _foreign_command(dht: KadDHT, host: BasicHost, cmd: dict[str, Any]) -> Any:
    op = cmd["op"]
    if op == "connect":
        with trio.fail_after(DHT_TIMEOUT_S):
            await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(cmd["addr"])))
        return {}
    if op == "probe":  # every kind of Kademlia request, sent to an atoll node
        peer = ID.from_base58(cmd["peer"])
        out: dict[str, Any] = {}
        with trio.fail_after(DHT_TIMEOUT_S):
            try:
                stream = await host.new_stream(peer, [TProtocol(IPFS_KAD)])
                await stream.close()
                out["negotiated"] = True
            except Exception as e:
                out["negotiated"] = False
                out["refusal"] = f"{type(e).__name__}: {e}"
            key = cmd["key"].encode()
            out["stored"] = await dht.value_store._store_at_peer(peer, key, b"foreign value")
            out["got"] = await dht.value_store._get_from_peer(peer, key) is not None
            out["closest"] = [
                str(p) for p in await dht.peer_routing._query_peer_for_closest(peer, key)
            ]
        return out
    if op == "table":
        return {"peers": [str(p) for p in dht.routing_table.get_peer_ids()]}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["node", "foreign"])
    parser.add_argument("--run", default=RUN)
    parser.add_argument("--seed", help="32-byte Ed25519 seed, hex")
    parser.add_argument("--bootstrap")
    parser.add_argument("--peer-record", action="store_true")
    parser.add_argument("--ready", help="FRAGMENT:SLOT to announce")
    parser.add_argument("--rpc-timeout-s", type=float, help="the DHT's bound of one request")
    parser.add_argument("--store-bounds", help="TOTAL,PER_PEER,FAIR_SHARE of the DHT's stores")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.mode == "node":
        trio.run(_node, args)
    else:
        trio.run(_foreign)


# -- the processes, seen from the tests ---------------------------------------------------------
@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    log_path: Path
    identity: Identity | None
    addr: str = ""
    started: dict[str, Any] = field(default_factory=dict)
    _buf: bytes = b""

    @property
    def peer_id(self) -> str:
        return self.addr.rsplit("/p2p/", 1)[1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def line(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line within {timeout_s} s:\n{self.log()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError(f"exited with {self.proc.wait(timeout=15)}:\n{self.log()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}).encode() + b"\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self.line(COMMAND_TIMEOUT_S))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the node's signal to exit
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        print(f"--- {self.log_path.name} ---\n{self.log()}")  # shown when a test fails


def spawn(log_path: Path, *args: str, identity: Identity | None = None) -> Node:
    argv = [sys.executable, str(HERE), *args]
    if identity is not None:
        argv += ["--seed", identity.private_bytes().hex()]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return Node(proc, log_path, identity)


def await_start(node: Node) -> Node:
    """Wait for LISTENING and the start-up line (bootstrap and publications done)."""
    try:
        line = node.line(START_TIMEOUT_S)
        assert line.startswith("LISTENING /ip4/127.0.0.1/tcp/"), line
        node.addr = line.split()[1]
        node.started = json.loads(node.line(START_TIMEOUT_S))
    except BaseException:
        node.proc.kill()
        node.proc.wait(timeout=15)
        print(node.log())
        raise
    return node


def record_of(hex_record: str) -> Record:
    record = decode_message(bytes.fromhex(hex_record))
    assert isinstance(record, PeerRecord | ReadyRecord | AttestationRecord)
    return record


@dataclass
class Swarm:
    boot: Node
    a: Node
    b: Node


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """A bootstrap node, then peers A and B that know only the bootstrap's address; A and
    B publish their PeerRecords and announce they are ready for fragment 3, slot 7."""
    tmp = tmp_path_factory.mktemp("dht")
    nodes: list[Node] = []
    try:
        boot = await_start(spawn(tmp / "boot.log", "node", identity=generate()))
        nodes.append(boot)
        peer_args = ["node", "--bootstrap", boot.addr, "--peer-record", "--ready", "3:7"]
        a = spawn(tmp / "a.log", *peer_args, identity=generate())
        nodes.append(a)
        b = spawn(tmp / "b.log", *peer_args, identity=generate())
        nodes.append(b)
        await_start(a)
        await_start(b)
        print(f"\nstart-up: A {a.started}\nB {b.started}")
        yield Swarm(boot, a, b)
    finally:
        for node in nodes:
            node.stop()


# -- the tests ----------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_a_peer_finds_another_peers_record_through_the_bootstrap(swarm: Swarm) -> None:
    a, b = swarm.a, swarm.b
    for node in (a, b):
        assert node.started["answered"] == 1, node.started
        assert swarm.boot.peer_id in node.started["table"]
    out = b.call("get", key=peer_key(RUN, a.peer_id))
    assert out.get("record"), out
    record = record_of(out["record"])
    assert isinstance(record, PeerRecord)
    assert record.peer_id == a.peer_id and record.addrs == (a.addr,)
    again = b.call("get", key=peer_key(RUN, a.peer_id))  # a second read goes to the network
    assert again.get("record") == out["record"], again
    # the bootstrap node now knows both peers as DHT servers
    table = swarm.boot.call("table")["peers"]
    assert {a.peer_id, b.peer_id} <= set(table), table
    print(
        f"\nbootstrap {a.started['bootstrap_s']:.3f}/{b.started['bootstrap_s']:.3f} s, "
        f"put {a.started['put_s']:.3f}/{b.started['put_s']:.3f} s, "
        f"announce {a.started['announce_s']:.3f}/{b.started['announce_s']:.3f} s, "
        f"get {out['s']:.3f} s then {again['s']:.3f} s"
    )


@pytest.mark.timeout(240)
def test_find_ready_returns_both_peers_ready_records(swarm: Swarm) -> None:
    a, b = swarm.a, swarm.b
    times = []
    for reader in (b, a, swarm.boot):  # a peer that announced, and one that did not
        out = reader.call("find_ready", fragment=3, slot=7)
        assert "records" in out, out
        records = [record_of(r) for r in out["records"]]
        assert all(isinstance(r, ReadyRecord) for r in records)
        assert [r.peer_id for r in records] == sorted([a.peer_id, b.peer_id]), out
        assert all((r.fragment, r.slot, r.run_id) == (3, 7, RUN) for r in records)
        times.append(out["s"])
    empty = b.call("find_ready", fragment=3, slot=8)  # nobody announced this slot
    assert empty.get("records") == [], empty
    print(f"\nfind_ready {', '.join(f'{t:.3f}' for t in times)} s; none {empty['s']:.3f} s")


@pytest.mark.timeout(240)
def test_attestations_of_two_members_are_found_and_make_a_certificate(swarm: Swarm) -> None:
    a, b = swarm.a, swarm.b
    members = sorted([a.peer_id, b.peer_id])
    digest = "5" * 32
    for node in (a, b):
        out = node.call(
            "announce_attestation", fragment=2, version=9, digest=digest, members=members
        )
        assert "error" not in out, out
    out = swarm.boot.call("find_attestations", fragment=2, version=9)
    records = [record_of(r) for r in out["records"]]
    assert [r.peer_id for r in records] == members, out
    assert all(isinstance(r, AttestationRecord) for r in records)
    cert = assemble(
        [r.attestation for r in records],  # type: ignore[union-attr]
        run_id=RUN,
        fragment=2,
        version=9,
        digest=digest,
        quorum=2,
        verifier=EnvelopeVerifier(),
    )
    assert cert is not None and sorted(cert.signers) == members
    assert b.call("find_attestations", fragment=2, version=10).get("records") == []
    print(f"\nfind_attestations {out['s']:.3f} s")


@pytest.mark.timeout(240)
def test_find_peers_returns_the_peer_records_both_peers_announced(swarm: Swarm) -> None:
    boot, a, b = swarm.boot, swarm.a, swarm.b
    # the swarm put its PeerRecords without announcing them, and no other test announces
    # one: the peers topic has no provider yet, so an empty list (the peers were asked)
    none = boot.call("find_peers")
    assert none.get("records") == [] and none["s"] < DHT_TIMEOUT_S, none
    now = time.time()
    ready = ready_record(a.peer_id, 3, 7, now)
    # what the directory reads of a peer: addresses, throughput, per-fragment versions
    a_record = replace(
        peer_record(a.peer_id, (a.addr,), now),
        tokens_per_s=1200.0,
        versions=(4, 0),
        digests=("ab" * 32, ""),
        serving=True,
    )
    b_record = replace(
        peer_record(b.peer_id, (b.addr,), now),
        tokens_per_s=800.5,
        versions=(3, 7),
        digests=("cd" * 32, "ef" * 32),
    )
    published = {a.peer_id: a_record, b.peer_id: b_record}
    # a node announces its own PeerRecord only
    for wrong in (published[b.peer_id], ready):
        out = a.call("announce_peer", record=encode_message(wrong).hex())
        assert out.get("error") == "ConfigError", out
    announced = []
    for node in (a, b):
        out = node.call("announce_peer", record=encode_message(published[node.peer_id]).hex())
        assert "error" not in out, out
        announced.append(out["s"])
    times = []
    for reader in (b, a, boot):  # the peers that announced, and one that did not
        out = reader.call("find_peers")
        assert "records" in out, out
        records = [record_of(r) for r in out["records"]]
        assert records == [published[p] for p in sorted(published)], out
        times.append(out["s"])
    print(
        f"\nannounce_peer {', '.join(f'{t:.3f}' for t in announced)} s; find_peers"
        f" {', '.join(f'{t:.3f}' for t in times)} s; none {none['s']:.3f} s"
    )


@pytest.mark.timeout(240)
def test_expired_or_badly_sealed_records_are_refused_and_never_returned(swarm: Swarm) -> None:
    boot, a, b = swarm.boot, swarm.a, swarm.b
    assert a.identity is not None
    x, y, z = generate(), generate(), generate()
    now = time.time()
    expired = peer_record(x.peer_id, (), now - 500, ttl=400)
    stranger = peer_record(y.peer_id, (), now)  # about Y, sealed by X: wrong signer
    good = encode_value(peer_record(z.peer_id, (), now), EnvelopeSigner(z))
    cases = {
        "expired": (expired.key(), encode_value(expired, EnvelopeSigner(x))),
        "signer": (stranger.key(), encode_value(stranger, EnvelopeSigner(x))),
        "seal": (peer_key(RUN, z.peer_id), good[:-1] + bytes([good[-1] ^ 1])),  # tampered
    }
    for rule, (key, value) in cases.items():
        # a serving peer's validator refuses to store it
        out = b.call("store_raw", peer=boot.peer_id, key=key, value=value.hex())
        assert out == {"stored": False, "s": out["s"]}, (rule, out)
        assert boot.call("has", key=key)["has"] is False, rule
        # a server that stored it anyway serves it; readers refuse it
        boot.call("inject", key=key, value=value.hex())
        assert boot.call("has", key=key)["has"] is True
        got = b.call("get", key=key)
        assert got.get("record", "missing") is None, (rule, got)
    assert f"held a refused value for {cases['seal'][0]}" in b.log()
    # strict validation: nothing outside /atoll/ is stored, not even libp2p's own kinds
    for key in ("/ipns/" + x.peer_id, "/pk/" + x.peer_id, "/other/key", "plain-key"):
        out = b.call("store_raw", peer=boot.peer_id, key=key, value=good.hex())
        assert out["stored"] is False and boot.call("has", key=key)["has"] is False, (key, out)

    # the publisher's own node refuses to publish a record that expired on its clock
    out = a.call("put", record=encode_message(peer_record(a.peer_id, (), now - 500, 400)).hex())
    assert (out.get("error"), out.get("rule")) == ("RejectedRecord", "expired"), out

    # a reader whose clock is 700 s ahead sees A's stored records as expired: not returned
    try:
        b.call("clock", offset=700)
        assert b.call("get", key=peer_key(RUN, a.peer_id)).get("record", "missing") is None
        assert b.call("find_ready", fragment=3, slot=7).get("records") == []
    finally:
        b.call("clock", offset=0)
    assert b.call("get", key=peer_key(RUN, a.peer_id)).get("record")


@pytest.mark.timeout(240)
def test_a_peer_of_the_ipfs_dht_is_not_admitted_and_not_answered(
    swarm: Swarm, tmp_path: Path, wait_until: Any
) -> None:
    a = swarm.a
    foreign = await_start(spawn(tmp_path / "foreign.log", "foreign"))
    try:
        foreign.call("connect", addr=a.addr)
        # wait until A's identify of the foreign peer is in: it serves /ipfs/kad/1.0.0
        wait_until(
            lambda: IPFS_KAD in a.call("protocols", peer=foreign.peer_id)["protocols"],
            60,  # identify follows the connection at once; a busy machine may take long
            "A's identify of the foreign peer (its /ipfs/kad/1.0.0)",
            interval_s=0.2,
        )
        assert str(DHT_PROTOCOL) not in a.call("protocols", peer=foreign.peer_id)["protocols"]
        probe = foreign.call("probe", peer=a.peer_id, key=peer_key(RUN, a.peer_id))
        assert probe["negotiated"] is False, probe  # A has no handler for /ipfs/kad/1.0.0
        assert (probe["stored"], probe["got"], probe["closest"]) == (False, False, []), probe
        # A's lookups ask every connected peer while its table is small: the foreign one
        # included, and it is still not admitted
        a.call("lookup")
        table = a.call("table")["peers"]
        assert foreign.peer_id not in table and swarm.boot.peer_id in table, table
        assert foreign.peer_id not in swarm.boot.call("table")["peers"]
        assert a.peer_id not in foreign.call("table")["peers"]  # nor A in the IPFS DHT
        print(f"\nforeign peer refused: {probe.get('refusal')}")
    finally:
        foreign.stop()


@pytest.mark.timeout(120)
def test_get_of_a_missing_key_returns_none_within_the_timeout(swarm: Swarm) -> None:
    out = swarm.b.call("get", key=peer_key(RUN, generate().peer_id))
    assert out.get("record", "missing") is None, out
    assert out["s"] < DHT_TIMEOUT_S, out
    print(f"\nget of a missing key: {out['s']:.3f} s")


def test_the_routing_table_admits_no_peer_it_knows_nothing_about() -> None:
    """In-process, no sockets: the library's table admits a peer whose protocols are
    unknown (identify not run, or not in the peerstore at all); atoll's does not."""
    kp = create_new_key_pair()
    host = new_host(key_pair=kp)
    me = ID.from_pubkey(kp.public_key)
    stranger = ID.from_pubkey(create_new_key_pair().public_key)
    info = PeerInfo(stranger, [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")])

    async def body() -> tuple[bool, bool, bool]:
        library = await RoutingTable(me, host).add_peer(info)
        kad_host: Any = _KadHost(host, Liveness(), 3.0)
        atoll = await RoutingTable(me, kad_host).add_peer(info)
        host.get_peerstore().add_protocols(stranger, [str(DHT_PROTOCOL)])
        identified = await RoutingTable(me, kad_host).add_peer(info)
        return library, atoll, identified

    assert trio.run(body) == (True, False, True)


@pytest.mark.timeout(120)
def test_a_peer_that_resets_a_dht_stream_after_its_hello_is_skipped_not_suspected() -> None:
    """Two hosts on 127.0.0.1; the second answers a stream's multistream hello and then
    resets the stream while the protocol is chosen, as a live peer's yamux resets a
    stream of a burst. The peer is talking: the DHT skips it for a while, but it is
    neither suspected nor silent (groups keep counting it, its connections stay). Once the
    second host is gone, a stream fails outright and the peer is silent."""
    from libp2p.host.exceptions import StreamFailure
    from libp2p.protocol_muxer.exceptions import MultiselectError

    from atoll.node.net.host import open_libp2p_host

    async def body() -> None:
        config = HostConfig(dial_timeout_s=10, hello_timeout_s=10, send_timeout_s=10)
        liveness = Liveness()
        async with open_libp2p_host(generate(), config) as a:
            kad_host: Any = _KadHost(a, liveness, 3.0)
            async with open_libp2p_host(generate(), config) as b:
                selector = b.get_mux()

                async def reset_after_hello(communicator: Any, timeout: int = 5) -> Any:
                    await selector.handshake(communicator)
                    await communicator.read()  # the protocol asked for: refused by a reset
                    raise MultiselectError("reset while the protocol is chosen")

                selector.negotiate = reset_after_hello
                b_id = b.get_id()
                peer = str(b_id)
                with trio.fail_after(30):
                    await a.connect(PeerInfo(b_id, b.get_transport_addrs()))
                    with pytest.raises(StreamFailure):
                        await kad_host.new_stream(b_id, [DHT_PROTOCOL])
                now = trio.current_time()
                assert liveness.skipped(peer, now)
                assert not liveness.suspected(peer, now) and not liveness.silent(peer)
                assert liveness.suspicions == 0 and liveness.skips == 1
                assert b_id in a.get_connected_peers()
            with trio.fail_after(30), pytest.raises(Exception):  # noqa: B017
                await kad_host.new_stream(b_id, [DHT_PROTOCOL])
            assert liveness.silent(peer)

    trio.run(body)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rpc_timeout_s": 0},
        {"rpc_timeout_s": 11.0},  # over timeout_s
        {"rpc_timeout_s": math.nan},
        {"rpc_timeout_s": True},
        {"liveness": object()},
    ],
)
def test_start_refuses_a_bad_request_bound_or_liveness(kwargs: dict[str, Any]) -> None:
    """In-process, no sockets: checked before anything starts."""
    host = new_host(key_pair=create_new_key_pair())
    identity = generate()

    async def body() -> None:
        async with AtollDHT.start(
            host,
            run_id=RUN,
            verifier=EnvelopeVerifier(),
            signer=EnvelopeSigner(identity),
            clock=ShiftedClock(),
            timeout_s=DHT_TIMEOUT_S,
            **kwargs,
        ):
            raise AssertionError("started")

    with pytest.raises(ConfigError):
        trio.run(body)


# -- a flood of records -------------------------------------------------------------------------
FLOOD_BOUNDS = StoreBounds(total=24, per_peer=8, fair_share=4)  # the flooded node's, small


@pytest.mark.timeout(300)
def test_a_flood_of_records_cannot_push_a_nodes_store_past_its_bounds(
    tmp_path: Path, wait_until: Any
) -> None:
    """Node N (small store bounds), an honest peer H that stored its records at N, and a
    flooder F that stores many more than the bounds at N: its own records, then those of
    20 fresh identities, then provider entries for many topics. N's stores stay within
    their bounds, F's entries are evicted first, N's and H's records are still found, N
    keeps answering, and N's log names F."""
    bounds = f"{FLOOD_BOUNDS.total},{FLOOD_BOUNDS.per_peer},{FLOOD_BOUNDS.fair_share}"
    nodes: list[Node] = []
    try:
        n = await_start(
            spawn(tmp_path / "n.log", "node", "--store-bounds", bounds, identity=generate())
        )
        nodes.append(n)
        h = spawn(
            tmp_path / "h.log",
            "node",
            "--bootstrap",
            n.addr,
            "--peer-record",
            "--ready",
            "3:7",
            identity=generate(),
        )
        nodes.append(h)
        f = spawn(tmp_path / "f.log", "node", "--bootstrap", n.addr, identity=generate())
        nodes.append(f)
        await_start(h)
        await_start(f)
        put = n.call(
            "put", record=encode_message(peer_record(n.peer_id, (n.addr,), time.time())).hex()
        )
        assert "error" not in put, put
        assert "error" not in n.call("announce_ready", fragment=3, slot=7)
        h_keys = [peer_key(RUN, h.peer_id), ready_key(RUN, 3, 7, h.peer_id)]
        before = n.call("usage")
        assert before["by_signer"] == {h.peer_id: 2}, before

        # F's own records: N keeps its newest per_peer, each arrival evicting F's oldest
        own = f.call("flood", peer=n.peer_id, slots=30, signers=0)
        assert own["sent"] == 30, own
        usage = n.call("usage")
        assert usage["by_signer"] == {h.peer_id: 2, f.peer_id: FLOOD_BOUNDS.per_peer}, usage
        kept = [ready_key(RUN, FLOOD_FRAGMENT, slot, f.peer_id) for slot in range(22, 30)]
        assert all(n.call("has", key=key)["has"] for key in kept)
        assert not n.call("has", key=ready_key(RUN, FLOOD_FRAGMENT, 0, f.peer_id))["has"]

        # 20 fresh identities, 3 records each: they fill the room, evict F down to its fair
        # share, then are refused; H's two records stay
        sybil = f.call("flood", peer=n.peer_id, slots=3, signers=20)
        assert sybil["sent"] == 60 and 0 < sybil["stored"] < 60, sybil
        usage = n.call("usage")
        assert usage["values"] == usage["store_values"] == FLOOD_BOUNDS.total, usage
        by_signer = usage["by_signer"]
        assert by_signer[h.peer_id] == 2 and by_signer[f.peer_id] == FLOOD_BOUNDS.fair_share
        fresh = [count for peer, count in by_signer.items() if peer not in (h.peer_id, f.peer_id)]
        assert sum(fresh) == FLOOD_BOUNDS.total - 2 - FLOOD_BOUNDS.fair_share, by_signer
        assert all(count <= 3 for count in fresh) and sybil["stored"] == sum(fresh), by_signer
        assert all(n.call("has", key=key)["has"] for key in h_keys)

        # provider entries: F announces itself for 10 topics; N keeps its newest per_peer
        assert "error" not in f.call("flood_providers", peer=n.peer_id, topics=10)

        def providers_bounded() -> bool:
            held = n.call("usage")
            return (
                f"dropped 1 provider entry of peer {f.peer_id}" in n.log()
                and held["by_provider"].get(f.peer_id) == FLOOD_BOUNDS.per_peer
            )

        wait_until(providers_bounded, 60, lambda: f"N dropping F's provider entries:\n{n.log()}")
        usage = n.call("usage")
        assert usage["providers"] == usage["store_providers"] <= FLOOD_BOUNDS.total, usage
        assert usage["by_provider"].get(h.peer_id) == 1, usage  # H's ready announcement

        # N keeps answering, and its own and H's records are found
        for key, owner in ((peer_key(RUN, n.peer_id), n), (h_keys[0], h)):
            got = f.call("get", key=key)
            assert got.get("record") and record_of(got["record"]).peer_id == owner.peer_id, got
        found = f.call("find_ready", fragment=3, slot=7)
        assert [record_of(r).peer_id for r in found.get("records", [])] == sorted(
            [n.peer_id, h.peer_id]
        ), found

        # N's log names the flooder, once a minute at most per peer and kind
        wait_until(
            lambda: (
                f"dropped 1 value of peer {f.peer_id}" in n.log()
                and "DHT store: refused 1 value of peer" in n.log()
                and f"(sent by {f.peer_id})" in n.log()
            ),
            30,
            lambda: f"N's log lines on the flood:\n{n.log()}",
        )
        # F lost 26 values to evictions: one line, and one more per minute the floods took
        lines = [
            line
            for line in n.log().splitlines()
            if "DHT store: dropped" in line and f"of peer {f.peer_id}:" in line and "value" in line
        ]
        assert 1 <= len(lines) <= 1 + (own["s"] + sybil["s"]) / 60, lines
        print(
            f"\nflood: N kept {usage['values']} values ({by_signer[f.peer_id]} of F's 30,"
            f" {sybil['stored']} of 60 fresh signers'), {usage['providers']} provider entries;"
            f" F's puts {own['s']:.3f} s and {sybil['s']:.3f} s"
        )
    finally:
        for node in nodes:
            node.stop()


# -- a silent peer: SIGSTOP ---------------------------------------------------------------------
SILENT_RPC_S = 2.0  # the DHT's bound of one request to one peer in the silent-peer test


@contextmanager
def stopped(node: Node) -> Iterator[float]:
    """``node``'s process stopped (SIGSTOP: the kernel still accepts its TCP data, nothing
    answers) for the block; resumed (SIGCONT) whatever happens. Yields the stop time
    (``time.monotonic``)."""
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)


@pytest.mark.timeout(420)
def test_a_silent_peer_costs_one_request_bound_then_nothing(
    tmp_path: Path, wait_until: Any
) -> None:
    """Five DHT nodes, one stopped: writes and reads finish at their quorum, well under
    the DHT's timeout; the stopped peer, once suspected, costs nothing; resumed, it is
    heard again."""
    rpc = ["--rpc-timeout-s", str(SILENT_RPC_S)]
    nodes: list[Node] = []
    try:
        boot = await_start(spawn(tmp_path / "boot.log", "node", *rpc, identity=generate()))
        nodes.append(boot)
        spawned = [
            spawn(
                tmp_path / f"{name}.log",
                "node",
                "--bootstrap",
                boot.addr,
                *rpc,
                identity=generate(),
            )
            for name in ("a", "b", "c", "s")
        ]
        nodes += spawned
        a, b, c, s = (await_start(node) for node in spawned)
        everyone = {node.peer_id for node in nodes}

        def tables_full() -> bool:
            for node in nodes:
                node.call("lookup")  # a lookup meets the peers its table lacks
            return all(
                set(node.call("table")["peers"]) == everyone - {node.peer_id} for node in nodes
            )

        wait_until(tables_full, 120, "every node's routing table holding the other four")

        published: list[PeerRecord] = []

        def put(node: Node) -> dict[str, Any]:
            record = peer_record(node.peer_id, (node.addr,), time.time())
            published.append(record)
            return node.call("put", record=encode_message(record).hex())

        healthy = put(a)
        assert "error" not in healthy, healthy
        with stopped(s):
            first = put(a)  # A's lookup meets the silent peer: one bound, then suspected
            assert "error" not in first and first["s"] < DHT_TIMEOUT_S / 2, first
            seen = a.call("liveness", peer=s.peer_id)
            assert seen["suspected"] and s.peer_id in seen["suspects"], seen
            second = put(a)  # suspected: neither looked up nor stored at
            assert "error" not in second and second["s"] < SILENT_RPC_S / 2, second
            got = b.call("get", key=peer_key(RUN, a.peer_id))  # B meets it for the first time
            assert got.get("record") and got["s"] < DHT_TIMEOUT_S / 2, got
            assert record_of(got["record"]) == published[-1]  # the newest
            assert b.call("liveness", peer=s.peer_id)["suspected"]
            again = b.call("get", key=peer_key(RUN, a.peer_id))
            assert again.get("record") == got["record"] and again["s"] < SILENT_RPC_S / 2, again
            announced = a.call("announce_ready", fragment=5, slot=1)
            assert "error" not in announced and announced["s"] < SILENT_RPC_S / 2, announced
            found = c.call("find_ready", fragment=5, slot=1)
            assert [record_of(r).peer_id for r in found.get("records", [])] == [a.peer_id], found
            assert found["s"] < DHT_TIMEOUT_S / 2, found
        resumed = time.monotonic()

        def heard_again() -> bool:
            # a probe: once the hold has passed, A's puts ask S again
            out = put(a)
            assert "error" not in out, out
            seen = a.call("liveness", peer=s.peer_id)
            return (
                not seen["suspected"]
                and not seen["silent"]
                and seen["heard_ago"] is not None
                and seen["heard_ago"] < time.monotonic() - resumed
            )

        wait_until(heard_again, 120, "A hearing from the resumed peer again", interval_s=0.5)
        back = time.monotonic() - resumed
        assert "error" not in s.call("get", key=peer_key(RUN, a.peer_id))  # S answers too
        print(
            f"\nput {healthy['s']:.3f} s healthy; with a stopped peer {first['s']:.3f} s, then"
            f" {second['s']:.3f} s; get {got['s']:.3f} s then {again['s']:.3f} s;"
            f" announce_ready {announced['s']:.3f} s; find_ready {found['s']:.3f} s"
            f" (rpc bound {SILENT_RPC_S} s, timeout {DHT_TIMEOUT_S} s); heard again"
            f" {back:.1f} s after it resumed"
        )
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                os.kill(node.proc.pid, signal.SIGCONT)
            node.stop()


if __name__ == "__main__":
    main()
