"""Asking several peers at once, done at a quorum: no request waits on a silent peer.

The DHT adapter (:mod:`atoll.dht.kad`) stores, reads and announces at the closest peers of
a key, one request per peer. :func:`ask` runs those requests with the rules that keep one
silent peer (a link that dropped without refusing anything) from holding up the rest:

- each request is bounded by ``rpc_timeout_s`` (from the moment it leaves the queue of at
  most ``concurrency`` requests under way);
- every outcome goes to the node's :class:`~atoll.protocol.liveness.Liveness`: an answer
  is :meth:`~atoll.protocol.liveness.Liveness.heard`, a request that timed out, raised or
  came back unanswered (:attr:`Reply.answered` False) is
  :meth:`~atoll.protocol.liveness.Liveness.failed`, one the peer reset before it was
  under way (:attr:`Reply.refused`) is :meth:`~atoll.protocol.liveness.Liveness.refused`;
- :func:`ask` returns once every peer is done, or once ``need`` replies counted
  (:attr:`Reply.value` not None) and ``grace_s`` more have passed (or every peer is done
  before that), or at ``deadline``, whichever comes first. Requests still under way then
  go on in the ``background`` nursery, each within its bound, so that their peers' liveness
  is still learned (their replies are not used); without one they are cancelled.

:func:`majority` is the quorum the adapter uses and :func:`without_skipped` the peers it
asks. Nothing here touches libp2p: a peer is any hashable value, a request any async
callable, and the clock is trio's (``trio.current_time``), so the unit tests run all of it
under ``trio.testing.MockClock``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

from atoll.protocol.errors import ConfigError
from atoll.protocol.liveness import Liveness

__all__ = ["Reply", "Tally", "ask", "majority", "without_skipped"]

logger = logging.getLogger(__name__)

P = TypeVar("P", bound=Hashable)  # a peer
T = TypeVar("T")  # what a reply carries


@dataclass(frozen=True, slots=True)
class Reply(Generic[T]):
    """What one request to one peer came to."""

    value: T | None = None
    """what counts toward the quorum (an acknowledgement, a valid record, a provider list);
    None when the peer answered with nothing that counts, or did not answer"""
    answered: bool = True
    """False: no answer (unreachable, refused, reset before it answered); the peer is then
    noted as failed"""
    reason: str = ""
    """why there was no answer, for the liveness record and the logs"""
    refused: bool = False
    """with ``answered`` False: the peer reset the request before it was under way; it
    is talking, so it is skipped by the DHT for a while but not suspected"""


@dataclass(frozen=True, slots=True)
class Tally(Generic[P, T]):
    """What :func:`ask` saw by the time it returned."""

    asked: int
    """peers asked"""
    need: int
    """replies needed for the quorum"""
    values: tuple[tuple[P, T], ...]
    """the replies that counted, (peer, value) in the order they arrived"""
    answered: int
    """peers that answered, counted or not"""
    failed: tuple[P, ...]
    """peers that did not answer: timed out, unreachable, refused"""
    pending: int
    """requests still under way when :func:`ask` returned (left to the background or
    cancelled)"""
    timed_out: bool
    """the deadline came before the quorum, and before every peer was done"""
    elapsed_s: float
    """seconds from the call to the return, on trio's clock"""

    @property
    def reached(self) -> bool:
        """Whether ``need`` replies counted."""
        return len(self.values) >= self.need


def majority(asked: int) -> int:
    """The quorum of ``asked`` peers: more than half of them (0 of none).

    A write done at a majority and a read done at a majority of the same peers share at
    least one peer, so the reader hears of the newest record the writer stored.
    """
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
        raise ConfigError(f"a number of peers must be an int >= 0, not {asked!r}")
    return asked // 2 + 1 if asked else 0


def without_skipped(
    peers: Sequence[P], liveness: Liveness, now: float, *, name: Callable[[P], str] = str
) -> list[P]:
    """``peers`` without the ones the DHT skips now (suspected, or refusing requests: see
    :meth:`~atoll.protocol.liveness.Liveness.skipped`), in order, or all of them when every
    one is skipped: better a probe than asking nobody."""
    live = [p for p in peers if not liveness.skipped(name(p), now)]
    return live if live else list(peers)


@dataclass(slots=True)
class _Progress(Generic[P, T]):
    """The mutable side of a :class:`Tally` while :func:`ask` runs."""

    values: list[tuple[P, T]] = field(default_factory=list)
    answered: int = 0
    failed: list[P] = field(default_factory=list)
    done: int = 0
    closed: bool = False  # ask returned: later replies only inform liveness


async def ask(
    peers: Sequence[P],
    call: Callable[[P], Awaitable[Reply[T]]],
    *,
    need: int,
    liveness: Liveness,
    rpc_timeout_s: float,
    grace_s: float = 0.0,
    deadline: float = math.inf,
    concurrency: int = 10,
    background: trio.Nursery | None = None,
    name: Callable[[P], str] = str,
) -> Tally[P, T]:
    """Run ``call(peer)`` for each of ``peers`` (see the module docstring for when it
    returns); ``need`` is the quorum, from 0 to ``len(peers)``.

    ``call`` returns a :class:`Reply`; one that raises counts as no answer (logged).
    ``name(peer)`` is the peer's key in ``liveness``. ``deadline`` is absolute, on
    ``trio.current_time()``. ``background`` is a nursery that outlives the caller (the
    DHT's own); when it is closed or None, what is still under way at the return is
    cancelled. Raises ``ConfigError`` for a ``need`` out of range or a bound that is not a
    positive number.
    """
    if isinstance(need, bool) or not isinstance(need, int) or not 0 <= need <= len(peers):
        raise ConfigError(f"need must be an int from 0 to {len(peers)}, not {need!r}")
    for what, value in (("rpc_timeout_s", rpc_timeout_s), ("grace_s", grace_s)):
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{what} must be a finite number >= 0, not {value!r}")
    if rpc_timeout_s == 0:
        raise ConfigError("rpc_timeout_s must be > 0")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"concurrency must be an int >= 1, not {concurrency!r}")
    start = trio.current_time()
    progress: _Progress[P, T] = _Progress()
    quorum = trio.Event()
    all_done = trio.Event()
    limiter = trio.CapacityLimiter(concurrency)

    async def one(peer: P) -> None:
        async with limiter:
            reply = await _bounded(call, peer, rpc_timeout_s)
        now = trio.current_time()
        if reply.answered:
            liveness.heard(name(peer), now)
        elif reply.refused:
            liveness.refused(name(peer), now)
        else:
            liveness.failed(name(peer), now, reply.reason or "no answer")
        if progress.closed:
            return
        progress.done += 1
        if reply.answered:
            progress.answered += 1
            if reply.value is not None:
                progress.values.append((peer, reply.value))
        else:
            progress.failed.append(peer)
        if len(progress.values) >= need:
            quorum.set()
        if progress.done == len(peers):
            all_done.set()
            quorum.set()

    if not peers or need == 0:
        quorum.set()
    if not peers:
        all_done.set()
    settled = False  # the quorum, or every peer done, came before the deadline
    try:
        async with trio.open_nursery() as local:
            target: trio.Nursery = local
            if background is not None and peers:
                try:
                    background.start_soon(one, peers[0])
                except RuntimeError:  # the background nursery is closed: shutting down
                    pass
                else:
                    target = background
            for peer in peers[1:] if target is background else peers:
                target.start_soon(one, peer)
            with trio.move_on_at(deadline):
                await quorum.wait()
                if grace_s > 0:
                    with trio.move_on_after(grace_s):
                        await all_done.wait()
            settled = quorum.is_set()
            progress.closed = True  # replies from here on only inform liveness
            local.cancel_scope.cancel()
    finally:
        progress.closed = True
    return Tally(
        asked=len(peers),
        need=need,
        values=tuple(progress.values),
        answered=progress.answered,
        failed=tuple(progress.failed),
        pending=len(peers) - progress.done,
        timed_out=not settled,
        elapsed_s=trio.current_time() - start,
    )


async def _bounded(call: Callable[[P], Awaitable[Reply[T]]], peer: P, bound: float) -> Reply[T]:
    """``call(peer)`` within ``bound`` seconds; no answer when it timed out or raised."""
    with trio.move_on_after(bound):
        try:
            return await call(peer)
        except Exception as e:  # a request must not take the nursery down with it
            logger.info("a request to %s failed: %s", peer, _describe(e))
            return Reply(answered=False, reason=_describe(e))
    return Reply(answered=False, reason=f"no answer within {bound:g} s")


def _describe(error: BaseException) -> str:
    text = str(error)
    name = type(error).__name__
    return f"{name}: {text}" if text else name
