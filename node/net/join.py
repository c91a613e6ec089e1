"""Joining a swarm through its ``--join`` addresses, and saying why a join failed.

:func:`join_swarm` tries every address at once, each on its own: a probe
(:func:`probe`: a dial and the Hello exchange), then the DHT bootstrap through it,
retried with backoff (1 s, doubling, at most 30 s apart). The whole join keeps to one
deadline, ``timeout_s`` after it starts: a dial, a probe or a bootstrap still under way
then is cut short, a wait between two tries never runs past it, and the join fails at
once with the reasons known by then. An address that answers ends the join: the other
addresses' tries under way get :data:`JOIN_GRACE_S` more to finish, none starts again.

The probe tells the reasons apart, so the user reads what to fix, in a few words that
name neither the address nor its peer: the address is unreachable (connection refused,
no answer in time), it is a peer of another run (its manifest differs), it speaks another
atoll protocol version, or a private run refused this node (or this node refused it).
All but the first are final: that address is not tried again, and when every address
says so the join fails at once with a ConfigError. The error names each address once,
one line per address: ``cannot join the swarm within 5 s through ADDR: REASON``.

The deadline counts from the call, not from the start of the process: importing torch,
building the model and starting the network process come first, and take seconds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from atoll.dht.kad import AtollDHT
from atoll.node.net.host import ATOLL_PROTOCOL, AtollHost, VersionMismatch, WrongRun
from atoll.node.net.peers import JoinFailed
from atoll.protocol.errors import AtollError, ConfigError, PeerUnavailable
from atoll.protocol.messages import PROTOCOL_VERSION
from atoll.security.membership import NotAMember

__all__ = ["JOIN_GRACE_S", "JoinFailed", "Refusal", "join_swarm", "probe"]

logger = logging.getLogger(__name__)

JOIN_GRACE_S = 1.0
"""once one address answered, how long the others' tries under way may still take"""
FIRST_RETRY_S = 1.0
"""the wait before an address is tried again; it doubles after each try"""
MAX_RETRY_S = 30.0
"""the longest wait between two tries of one address"""
PROBE_SLACK_S = 5.0
"""a probe's bound beyond the manifest's ``dial_s`` (the Hello exchange after the dial)"""
_MAX_REASON_CHARS = 160  # a reason is one short clause of one line


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why one ``--join`` address did not let this node in."""

    reason: str
    """a few words on one line, naming neither the address nor its peer"""
    final: bool = False
    """retrying cannot help (another run, another protocol version, a refused member)"""
    reached: bool = False
    """the peer answered (the DHT bootstrap through it may still work)"""


@dataclass(slots=True)
class _Address:
    """One address's tries: the latest refusal, and how its current try goes."""

    addr: str
    refusal: Refusal | None = None
    joined: bool = False
    trying: bool = False
    bootstrapping: bool = False  # its probe passed, the DHT bootstrap is under way
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


async def join_swarm(
    host: AtollHost,
    dht: AtollDHT,
    addrs: Sequence[str],
    *,
    timeout_s: float,
    dial_s: float,
) -> int:
    """Join the DHT through ``addrs``, each tried with backoff, all within ``timeout_s``.

    Returns how many addresses answered (0 only when there are none). Raises
    :class:`JoinFailed` at the deadline when none did, a ConfigError as soon as every
    address refused for good (another run, another protocol version, a private run's
    refusal, a malformed address); either one names each address once, one line per
    address.
    """
    if not addrs:
        return 0
    addrs = list(dict.fromkeys(addrs))  # an address given twice is tried once
    started = trio.current_time()
    deadline = started + timeout_s
    states = [_Address(a) for a in addrs]
    logger.info(
        "joining the swarm through %d address%s, for up to %g s",
        len(addrs),
        "" if len(addrs) == 1 else "es",
        timeout_s,
    )

    def on_joined() -> None:
        # the addresses waiting to try again stop now; a try under way may finish
        grace = min(deadline, trio.current_time() + JOIN_GRACE_S)
        for s in states:
            if not s.joined:
                if s.trying:
                    s.scope.deadline = min(s.scope.deadline, grace)
                else:
                    s.scope.cancel()

    async def keep_trying(state: _Address) -> None:
        with state.scope:
            delay = FIRST_RETRY_S
            while True:
                state.trying = True
                refusal = await _try(host, dht, state, dial_s)
                state.trying = False
                if refusal is None:
                    state.joined = True
                    on_joined()
                    return
                state.refusal = refusal
                if refusal.final or any(s.joined for s in states):
                    return
                wait = min(delay, max(0.0, deadline - trio.current_time()))
                logger.info(
                    "join through %s: %s; trying again in %.1f s", state.addr, refusal.reason, wait
                )
                await trio.sleep(delay)  # the deadline cuts it short
                delay = min(delay * 2, MAX_RETRY_S)

    with trio.move_on_at(deadline):
        async with trio.open_nursery() as nursery:
            for state in states:
                nursery.start_soon(keep_trying, state)
    joined = [s for s in states if s.joined]
    if joined:
        for s in states:
            if s.refusal is not None and not s.joined:
                level = logging.WARNING if s.refusal.final else logging.INFO
                logger.log(level, "not joined through %s: %s", s.addr, s.refusal.reason)
        logger.info(
            "joined the swarm through %d of %d address%s in %.1f s",
            len(joined),
            len(states),
            "" if len(states) == 1 else "es",
            trio.current_time() - started,
        )
        return len(joined)
    final = all(s.refusal is not None and s.refusal.final for s in states)
    within = "" if final else f" within {timeout_s:g} s"
    lines = []
    for s in states:
        if s.bootstrapping:
            reason = f"it answered, but the DHT bootstrap through it took over {timeout_s:g} s"
        elif s.refusal is not None:
            reason = s.refusal.reason
        else:
            reason = f"unreachable (no answer within {timeout_s:g} s)"
        lines.append(f"cannot join the swarm{within} through {s.addr}: {reason}")
    if final:
        raise ConfigError("\n".join(lines))
    raise JoinFailed("\n".join(lines))


async def _try(host: AtollHost, dht: AtollDHT, state: _Address, dial_s: float) -> Refusal | None:
    """One try of one address: the probe, then the DHT bootstrap through it; None when it
    let this node in. The caller's deadline may cut it short anywhere."""
    state.bootstrapping = False
    refusal = await probe(host, state.addr, dial_s)
    if refusal is not None and (refusal.final or not refusal.reached):
        return refusal
    state.bootstrapping = True  # left set when the deadline cuts the bootstrap short
    answered = await dht.bootstrap([state.addr]) > 0
    state.bootstrapping = False
    if answered:
        return None
    return refusal or Refusal("it answered, but not as a DHT peer", reached=True)


async def probe(host: AtollHost, addr: str, dial_s: float) -> Refusal | None:
    """Why ``addr`` cannot be this run's peer, or None when it can (a node of this run, or
    a bootstrap peer: atoll's DHT only, no message protocol). Bounded by ``dial_s`` plus
    :data:`PROBE_SLACK_S`; a malformed address is a final refusal."""
    peer = addr.rsplit("/p2p/", 1)[1] if "/p2p/" in addr else ""
    bound = dial_s + PROBE_SLACK_S
    with trio.move_on_after(bound):
        try:
            await host.connect(addr)
            return None
        except WrongRun:
            return Refusal(
                "that peer trains another run (its manifest differs from this one's)",
                final=True,
                reached=True,
            )
        except VersionMismatch as e:
            if e.version is not None:
                return Refusal(
                    f"that peer speaks atoll protocol version {e.version}, this node "
                    f"{PROTOCOL_VERSION}",
                    final=True,
                    reached=True,
                )
            if any(p.endswith("/msg") for p in e.offered):
                return Refusal(
                    f"that peer speaks another atoll protocol version (it serves "
                    f"{', '.join(e.offered)}; this node {ATOLL_PROTOCOL})",
                    final=True,
                    reached=True,
                )
            if e.offered:
                return None  # a bootstrap peer: atoll's DHT only, no message protocol
            return Refusal(
                "it serves no atoll protocol (not an atoll peer, or another version)",
                reached=True,
            )
        except NotAMember as e:
            if e.peer_id == host.peer_id:
                return Refusal(
                    "that peer refused this node: it does not count it as a member of the "
                    "run, or it trains another run (check --cert, the certificate's expiry "
                    "and the manifest's [membership] table)",
                    final=True,
                    reached=True,
                )
            return Refusal(
                f"that peer is not a member of this run: {_quiet(e.reason, addr, peer)}",
                final=True,
                reached=True,
            )
        except ConfigError as e:  # a malformed address, this node's own
            return Refusal(_quiet(str(e), addr, peer), final=True)
        except PeerUnavailable as e:
            return Refusal(f"unreachable ({_cause(e, addr, peer)})")
        except AtollError as e:  # it answered, but not with a Hello
            return Refusal(_quiet(str(e), addr, peer), reached=True)
    return Refusal(f"unreachable (no answer within {bound:g} s)")


def _cause(error: BaseException, addr: str, peer: str) -> str:
    """The root of a failed dial in a few words: the operating system's reason when one
    is at the bottom of the chain (``connection refused``), else the error's own text."""
    pending: list[BaseException] = [error]
    seen: set[int] = set()
    while pending:
        e = pending.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            text = os.strerror(e.errno)
            return text[:1].lower() + text[1:]
        if isinstance(e, BaseExceptionGroup):
            pending.extend(e.exceptions)
        # py-libp2p's MultiError holds its errors as a list in its first argument
        if e.args and isinstance(e.args[0], list):
            pending.extend(x for x in e.args[0] if isinstance(x, BaseException))
        if e.__cause__ is not None:
            pending.append(e.__cause__)
    return _quiet(str(error), addr, peer)


def _quiet(text: str, addr: str, peer: str) -> str:
    """``text`` on one line, short, without ``addr`` and ``peer`` (the error names the
    address once, before the reason)."""
    for name in (repr(addr), addr):
        text = text.replace(f" at {name}", "").replace(name, "the address")
    if peer:
        text = text.replace(f"peer {peer}", "the peer").replace(peer, "the peer")
    text = " ".join(text.split())
    if len(text) > _MAX_REASON_CHARS:
        text = text[: _MAX_REASON_CHARS - 3] + "..."
    return text
