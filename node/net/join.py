"""Joining a swarm through its ``--join`` addresses, and saying why a join failed.

:func:`join_swarm` bootstraps the DHT through every address, retrying with backoff (1 s,
doubling, at most 30 s apart) until one answers or ``timeout_s`` runs out. A probe of each
address (:func:`probe`) tells the reasons apart, so the user reads one line that names
what to fix: the address is unreachable, it is a peer of another run (its manifest
differs), or it speaks another atoll protocol version. The last two are final: when every
address says so, retrying cannot help and the join fails at once with a ConfigError.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from atoll.dht.kad import AtollDHT
from atoll.node.net.host import AtollHost, VersionMismatch, WrongRun
from atoll.node.net.peers import JoinFailed
from atoll.protocol.errors import AtollError, ConfigError, PeerUnavailable

__all__ = ["JoinFailed", "join_swarm", "probe"]

logger = logging.getLogger(__name__)


async def join_swarm(
    host: AtollHost,
    dht: AtollDHT,
    addrs: Sequence[str],
    *,
    timeout_s: float,
    dial_s: float,
) -> int:
    """Join the DHT through ``addrs``, retrying with backoff for up to ``timeout_s``.

    Returns how many addresses answered. Raises :class:`JoinFailed` naming, per address,
    why it did not let this node in, when none did in time; ConfigError at once when
    every address is a peer of another run or another protocol version (retrying cannot
    help).
    """
    if not addrs:
        return 0
    deadline = trio.current_time() + timeout_s
    delay = 1.0
    reasons: dict[str, str] = {}
    while True:
        joined = 0
        fatal = 0
        for addr in addrs:
            # the Hello first: a private run's bootstrap serves the DHT to members only
            reason = await probe(host, addr, dial_s)
            if reason is not None and reason.startswith("fatal:"):
                fatal += 1
                reasons[addr] = reason.removeprefix("fatal:")
                continue
            ok = await dht.bootstrap([addr]) > 0
            if ok:
                joined += 1
                reasons.pop(addr, None)
            else:
                reasons[addr] = reason or "did not answer as a DHT peer"
        if joined:
            return joined
        detail = "; ".join(f"{a}: {r}" for a, r in reasons.items())
        if fatal == len(addrs):
            raise ConfigError(f"cannot join the swarm: {detail}")
        left = deadline - trio.current_time()
        if left <= 0:
            raise JoinFailed(f"cannot join the swarm within {timeout_s:.0f} s: {detail}")
        logger.warning("joining failed (%s); retrying in %.0f s", detail, min(delay, left))
        await trio.sleep(min(delay, left))
        delay = min(delay * 2, 30.0)


async def probe(host: AtollHost, addr: str, dial_s: float) -> str | None:
    """Why ``addr`` cannot be this run's peer ("fatal:" first when retrying is useless),
    or None when it can (a node of this run, or a bootstrap peer)."""
    with trio.move_on_after(dial_s + 5):
        try:
            await host.connect(addr)
            return None
        except WrongRun:
            return "fatal:that peer trains another run (its manifest differs from this one's)"
        except VersionMismatch as e:
            if any(p.endswith("/msg") for p in e.offered):
                return f"fatal:that peer speaks another atoll protocol version ({e})"
            if e.offered:
                return None  # a bootstrap peer: atoll's DHT only, no message protocol
            return "it serves no atoll protocol (not an atoll peer, or another version)"
        except ConfigError as e:
            return f"fatal:{e}"
        except PeerUnavailable as e:
            return f"unreachable ({e})"
        except AtollError as e:
            return str(e)
    return f"unreachable (no answer within {dial_s + 5:.0f} s)"
