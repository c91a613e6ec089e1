"""The node's status, as the network process reports it to the trainer.

The network process (the swarm worker) keeps one :class:`NodeStatus` and sends the whole
of it over the bridge whenever it changes or once a second
(:func:`~atoll.node.net.bridge.post_status`); the trainer reads the latest one as
:attr:`NetworkBridge.status <atoll.node.net.bridge.NetworkBridge.status>`: who this peer
is, where it starts, the swarm it sees, the bytes it moved and how its rounds went.

On the wire (msgpack) and in JSON summaries the status is a plain dict whose keys are the
field names (:meth:`NodeStatus.to_wire`, :meth:`NodeStatus.as_dict`): tuples become
lists, ``last_sync``'s fragment keys become strings. :meth:`NodeStatus.from_wire` checks
every field it reads and raises :class:`BadStatus` on a wrong type (the bridge logs it
and keeps the status it had); keys it does not know are ignored (a newer worker).
:meth:`NodeStatus.updated` applies a partial dict: it changes only the fields it names.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from atoll.protocol.errors import RejectedInput

__all__ = ["BadStatus", "NodeStatus"]

log = logging.getLogger(__name__)

History = tuple[int, int, str, str]
"""(fragment, version, digest, round): round is ``"slot/leader"`` or ``"rebase"``"""
Outcome = tuple[int, int, str, float, bool]
"""(fragment, version, round status, seconds, rebased) of one sync"""


class BadStatus(RejectedInput, ValueError):
    """A status dict from the network process holds a value of the wrong type."""


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What the network process knows about this node (all fields have defaults)."""

    peer_id: str = ""
    """this peer's libp2p id"""
    run_id: str = ""
    """the run's id (the manifest's hash)"""
    addrs: tuple[str, ...] = ()
    """the multiaddrs this peer listens on"""
    start_step: int = 0
    """the inner step to start training from (after catching up with the swarm)"""
    joined: int = 0
    """how many ``--join`` addresses answered (0: this peer started the swarm)"""
    swarm_step: int = 0
    """the swarm's inner step as of the last rebase (the trainer may jump there)"""
    peers_seen: int = 0
    """peers of the run seen so far (this one excluded)"""
    dht_peers: int = 0
    """peers in the DHT's routing table"""
    peers_live: int = 0
    """peers with a live record that answer (this one excluded): those that count"""
    suspicions: int = 0
    """times a peer stopped answering and was set aside for a while"""
    dht_skips: int = 0
    """times a peer that reset a DHT request was left out of the DHT's requests for a
    while (it stays live for groups)"""
    fallbacks: int = 0
    """times a fragment went back from a committed state that too few of its round's
    members were left to certify"""
    bytes_per_peer: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """peer id -> (bytes sent to it, bytes received from it), at most 64 peers"""
    bytes_up: int = 0
    """bytes sent, all peers"""
    bytes_down: int = 0
    """bytes received, all peers"""
    rounds_applied: int = 0
    rounds_failed: int = 0
    rounds_alone: int = 0
    """rounds that found no group (nothing applied)"""
    rounds_ahead: int = 0
    """rounds applied in a group formed ahead of the sync (atoll.node.net.ahead)"""
    rebases: int = 0
    """fragments copied from a peer that held the swarm's leading state"""
    last_sync: Mapping[int, str] = field(default_factory=dict)
    """fragment -> how its last sync ended, in words"""
    round_s: tuple[float, ...] = ()
    """seconds of the last rounds (at most 50)"""
    round_bytes: tuple[int, ...] = ()
    """bytes of the last rounds (at most 50)"""
    group_sizes: tuple[int, ...] = ()
    """group size of the last rounds (at most 50)"""
    versions: tuple[int, ...] = ()
    """each fragment's global version"""
    history: tuple[History, ...] = ()
    """(fragment, version, digest, round) after every applied round and rebase"""
    outcomes: tuple[Outcome, ...] = ()
    """(fragment, version, round status, seconds, rebased) of every sync"""
    banned: tuple[str, ...] = ()
    """the peers banned now (:class:`~atoll.protocol.strikes.Strikes`)"""
    strikes: int = 0
    """strikes this node gave so far, all peers"""
    bans: int = 0
    """bans this node gave so far, all peers"""
    reach: str = ""
    """whether peers can dial this node (``public``, ``private``, ``unknown``; empty
    until its dial-back check ends, :mod:`~atoll.node.net.dialback`)"""

    # -- wire ----------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """A plain dict of lists, strings and numbers (msgpack and JSON both carry it)."""
        return {
            "peer_id": self.peer_id,
            "run_id": self.run_id,
            "addrs": list(self.addrs),
            "start_step": self.start_step,
            "joined": self.joined,
            "swarm_step": self.swarm_step,
            "peers_seen": self.peers_seen,
            "dht_peers": self.dht_peers,
            "peers_live": self.peers_live,
            "suspicions": self.suspicions,
            "dht_skips": self.dht_skips,
            "fallbacks": self.fallbacks,
            "bytes_per_peer": {k: list(v) for k, v in self.bytes_per_peer.items()},
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "rounds_applied": self.rounds_applied,
            "rounds_failed": self.rounds_failed,
            "rounds_alone": self.rounds_alone,
            "rounds_ahead": self.rounds_ahead,
            "rebases": self.rebases,
            "last_sync": {str(k): v for k, v in self.last_sync.items()},
            "round_s": list(self.round_s),
            "round_bytes": list(self.round_bytes),
            "group_sizes": list(self.group_sizes),
            "versions": list(self.versions),
            "history": [list(h) for h in self.history],
            "outcomes": [list(o) for o in self.outcomes],
            "banned": list(self.banned),
            "strikes": self.strikes,
            "bans": self.bans,
            "reach": self.reach,
        }

    def as_dict(self) -> dict[str, Any]:
        """The status for a JSON summary: the wire dict (same keys, JSON types)."""
        return self.to_wire()

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> NodeStatus:
        """A status from a wire dict; missing fields keep their defaults.

        Raises :class:`BadStatus` when ``data`` is not a dict or a field has the wrong
        type; unknown keys are ignored (logged at debug level).
        """
        return cls().updated(data)

    def updated(self, data: Mapping[str, Any]) -> NodeStatus:
        """This status with the fields ``data`` names replaced (a partial wire dict)."""
        if not isinstance(data, Mapping):
            raise BadStatus(f"a node status is a dict, not {type(data).__name__}")
        changes: dict[str, Any] = {}
        for key, value in data.items():
            parse = _PARSERS.get(key) if isinstance(key, str) else None
            if parse is None:
                log.debug("node status: unknown key %r ignored", key)
                continue
            try:
                changes[key] = parse(value)
            except (TypeError, ValueError) as e:
                raise BadStatus(f"node status field {key!r}: {e}") from None
        return dataclasses.replace(self, **changes) if changes else self


# -- checked conversions ------------------------------------------------------------------
def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {type(v).__name__} {v!r:.40}")
    return v


def _float(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"expected a number, got {type(v).__name__} {v!r:.40}")
    return float(v)


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__} {v!r:.40}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected a boolean, got {type(v).__name__} {v!r:.40}")
    return v


def _seq(v: object) -> list[Any]:
    if not isinstance(v, list | tuple):
        raise TypeError(f"expected a list, got {type(v).__name__} {v!r:.40}")
    return list(v)


def _map(v: object) -> Mapping[Any, Any]:
    if not isinstance(v, Mapping):
        raise TypeError(f"expected a dict, got {type(v).__name__} {v!r:.40}")
    return v


def _tuple_of(item: Callable[[object], Any]) -> Callable[[object], tuple[Any, ...]]:
    def parse(v: object) -> tuple[Any, ...]:
        return tuple(item(x) for x in _seq(v))

    return parse


def _record(*items: Callable[[object], Any]) -> Callable[[object], tuple[Any, ...]]:
    def parse(v: object) -> tuple[Any, ...]:
        xs = _seq(v)
        if len(xs) != len(items):
            raise ValueError(f"expected {len(items)} items, got {len(xs)}")
        return tuple(f(x) for f, x in zip(items, xs, strict=True))

    return parse


def _fragment_key(k: object) -> int:
    if isinstance(k, str) and k.isdigit():
        return int(k)
    return _int(k)


def _last_sync(v: object) -> dict[int, str]:
    return {_fragment_key(k): _str(s) for k, s in _map(v).items()}


def _pair(v: object) -> tuple[int, int]:
    sent, received = _record(_int, _int)(v)
    return sent, received


def _bytes_per_peer(v: object) -> dict[str, tuple[int, int]]:
    return {_str(k): _pair(x) for k, x in _map(v).items()}


_PARSERS: dict[str, Callable[[object], Any]] = {
    "reach": _str,
    "peer_id": _str,
    "run_id": _str,
    "addrs": _tuple_of(_str),
    "start_step": _int,
    "joined": _int,
    "swarm_step": _int,
    "peers_seen": _int,
    "dht_peers": _int,
    "peers_live": _int,
    "suspicions": _int,
    "dht_skips": _int,
    "fallbacks": _int,
    "bytes_per_peer": _bytes_per_peer,
    "bytes_up": _int,
    "bytes_down": _int,
    "rounds_applied": _int,
    "rounds_failed": _int,
    "rounds_alone": _int,
    "rounds_ahead": _int,
    "rebases": _int,
    "last_sync": _last_sync,
    "round_s": _tuple_of(_float),
    "round_bytes": _tuple_of(_int),
    "group_sizes": _tuple_of(_int),
    "versions": _tuple_of(_int),
    "history": _tuple_of(_record(_int, _int, _str, _str)),
    "outcomes": _tuple_of(_record(_int, _int, _str, _float, _bool)),
    "banned": _tuple_of(_str),
    "strikes": _int,
    "bans": _int,
}
