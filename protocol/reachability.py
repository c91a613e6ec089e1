"""Reachability: whether the peers of a swarm can dial this node, learnt by dial-back.

A node behind a NAT or a firewall can dial out but cannot be dialed, and nothing on the
node itself says which it is: its listen address is a private one either way. So it asks
peers that can be reached (a bootstrap peer, say) to dial it back, in the manner of
libp2p's AutoNAT: a :class:`DialBackRequest` names the ports it listens on; the server
dials each on a fresh connection, at the address it observed the request come from and
nowhere else (so that nobody can point a server at a third party), and answers with a
:class:`DialBackReply`: the address and port it observed, the ports it reached, and its
own wall clock (the asker learns its clock skew on the way).

From the replies of one or more servers :func:`verdict` says what the node is:

- ``public``: some server reached one of its ports;
- ``private``: at least :data:`PRIVATE_AFTER` servers answered and none reached it (a
  NAT or a firewall in the way);
- ``unknown``: fewer answered.

Sans-IO: the dial, the stream and the clock are :mod:`atoll.node.net.dialback`'s.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from atoll.protocol.messages import wire_message

__all__ = [
    "MAX_PORTS",
    "PRIVATE_AFTER",
    "DialBackReply",
    "DialBackRequest",
    "Verdict",
    "dialable",
    "verdict",
]

MAX_PORTS = 4
"""a request names at most this many ports (a server dials no more per request)"""
PRIVATE_AFTER = 1
"""how many servers that answered without reaching the node make it ``private``"""

Reach = Literal["public", "private", "unknown"]


@wire_message(50)
@dataclass(frozen=True, slots=True)
class DialBackRequest:
    """Dial me back at these ports of the address you see me at."""

    nonce: bytes = field(metadata={"max_len": 32})
    ports: tuple[int, ...] = field(metadata={"max_len": MAX_PORTS})


@wire_message(51)
@dataclass(frozen=True, slots=True)
class DialBackReply:
    """What the server saw and reached."""

    nonce: bytes = field(metadata={"max_len": 32})
    observed_ip: str = field(metadata={"max_len": 64})
    """the address the request came from, as the server saw it"""
    observed_port: int
    """the port it came from (the NAT's mapping of the asker's outgoing connection)"""
    reached: tuple[int, ...] = field(metadata={"max_len": MAX_PORTS})
    """the requested ports a fresh connection reached, at ``observed_ip``"""
    wall_s: float
    """the server's wall clock when it answered (seconds since the epoch)"""
    detail: str = field(default="", metadata={"max_len": 200})
    """why nothing was dialed, when nothing was (a refusal)"""


def dialable(observed_ip: str, ports: Sequence[int]) -> list[tuple[str, int]]:
    """The ``(address, port)`` pairs a server may dial for a request from
    ``observed_ip``: that address only (never one the request names), valid ports only,
    at most :data:`MAX_PORTS`, no duplicates; none for an address that is not an IP (a
    relayed connection, say)."""
    try:
        ip = ipaddress.ip_address(observed_ip)
    except ValueError:
        return []
    if ip.is_unspecified or ip.is_multicast:
        return []
    out: list[tuple[str, int]] = []
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            continue
        if (str(ip), port) not in out:
            out.append((str(ip), port))
    return out[:MAX_PORTS]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the replies say about this node."""

    reach: Reach
    observed: tuple[str, ...]
    """``ip:port`` as each server saw this node, in the order of the replies"""
    reached: tuple[int, ...]
    """the ports some server reached"""
    skew_s: float | None
    """the median of (server's clock - this node's clock) over the replies, None without"""
    answered: int

    def line(self) -> str:
        """The verdict in one line, with what to do about it."""
        seen = ", ".join(self.observed) or "nobody"
        if self.reach == "public":
            ports = ", ".join(map(str, self.reached))
            return f"reachable: peers dialed this node back at port {ports} (seen as {seen})"
        if self.reach == "private":
            return (
                f"not reachable: {self.answered} peers could not dial this node back (seen as"
                f" {seen}); it is behind a NAT or a firewall: forward its listen port on the"
                " router, or join through a relay"
            )
        return "reachability unknown: no peer answered a dial-back request"


def verdict(replies: Sequence[DialBackReply], *, local_wall_s: Sequence[float]) -> Verdict:
    """The verdict of ``replies`` (one per server that answered); ``local_wall_s`` is
    this node's clock when each arrived (the same order), for the skew."""
    reached = sorted({p for r in replies for p in r.reached})
    observed = tuple(f"{r.observed_ip}:{r.observed_port}" for r in replies)
    skews = sorted(r.wall_s - t for r, t in zip(replies, local_wall_s, strict=True))
    skew = skews[(len(skews) - 1) // 2] if skews else None
    if reached:
        reach: Reach = "public"
    elif len(replies) >= PRIVATE_AFTER:
        reach = "private"
    else:
        reach = "unknown"
    return Verdict(reach, observed, tuple(reached), skew, len(replies))
