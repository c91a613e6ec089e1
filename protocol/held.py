"""Held trainers: who waits at which fragment's slot, so that no two waits wait on each other.

A node that reaches a fragment's sync before the peers due at its slot holds its trainer
there (matchmaking's patience, docs/DESIGN.md): a held trainer trains no further, so the
peer does not reach any other slot until the hold ends. With several fragments in flight
this can close a circle. After a split heals, the faults benchmark's logs showed node A
held at fragment 2's slot for node B, B held at fragment 0's slot for node C, and C held
at fragment 2 as a member of A's group: none of them trains on to the slot another waits
at, and all wait out their patience (27 s there) before any round forms.

So a node whose trainer stays held tells the peers of the run (:class:`Held`, once the
hold has lasted a grace period, and again with ``seconds = 0`` when it ends), and
:class:`HeldPeers` keeps what it was told. A sync that waits with patience only for peers
held at another fragment's slot releases its own trainer: it keeps its matchmaking open
for them (they come when their own waits end), while its trainer trains on to its next
slots, where the others may be waiting for it. A notice says where the sender's trainer
is, nothing about any state: a peer that lies in one costs the receiver at most its own
trainer running ahead of the swarm by a sync or so, which matchmaking's step checks
bound.

Sans-IO: the caller brings the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from atoll.protocol.messages import wire_message

__all__ = ["HELD_MAX_S", "Held", "HeldPeers"]

HELD_MAX_S: float = 3600.0
"""The longest hold a notice may announce (a longer one is read as this long)."""

_ID = {"max_len": 128}


@wire_message(25)
@dataclass(frozen=True, slots=True)
class Held:
    """``sender``'s trainer is held at ``fragment``'s sync for at most ``seconds`` more
    (0: it is not held there any more)."""

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    seconds: float


class HeldPeers:
    """What peers said of their held trainers: ``peer -> (fragment, until)``."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, float]] = {}

    def note(self, msg: Held, *, now: float) -> bool:
        """Take ``msg`` (its sender authenticated by the caller); False when it makes no
        sense (a negative fragment, a negative or non-finite duration) and is ignored."""
        if msg.fragment < 0 or not math.isfinite(msg.seconds) or msg.seconds < 0:
            return False
        if msg.seconds == 0:
            self._held.pop(msg.sender, None)
        else:
            self._held[msg.sender] = (msg.fragment, now + min(msg.seconds, HELD_MAX_S))
        return True

    def held_at(self, peer: str, *, now: float) -> int | None:
        """The fragment whose sync holds ``peer``'s trainer now (None: not held)."""
        entry = self._held.get(peer)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._held[peer]
            return None
        return entry[0]

    def elsewhere(self, peer: str, fragment: int, *, now: float) -> bool:
        """Whether ``peer``'s trainer is held now at another fragment's sync than
        ``fragment`` (it cannot come to ``fragment``'s slot before that hold ends)."""
        at = self.held_at(peer, now=now)
        return at is not None and at != fragment

    def forget(self, peer: str) -> None:
        """``peer`` left or went silent: what it said no longer holds."""
        self._held.pop(peer, None)
