"""The one exception tree of atoll.

Every error atoll raises on purpose derives from :class:`AtollError`. The tree separates
failures a caller should retry (a peer went away, a wait timed out) from failures caused
by bad or hostile input (a contribution that does not decode, a value that is not finite),
so that a node can back off from the first kind and strike a peer for the second::

    AtollError
    ├── ConfigError              bad configuration or arguments given by the user
    ├── RetryableError           transient: try again, maybe with another peer
    │   ├── PeerUnavailable      a peer could not be reached or left mid-round
    │   │   └── PeerTimedOut     it did not answer within a bound (silent, not reset)
    │   ├── ExchangeTimeout      a bounded wait ran out
    │   └── RoundAborted         a round ended without a result; nothing was applied
    └── RejectedInput            input that must not be used; never retried as is
        ├── CodecError           bytes that do not decode, wrong size, non-finite values
        └── RejectedContribution a peer's part failed validation (hostile or broken)

``ConfigError`` and ``CodecError`` also derive from :class:`ValueError`, so callers that
only know the standard library still catch them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = [
    "AtollError",
    "CodecError",
    "ConfigError",
    "ExchangeTimeout",
    "PeerTimedOut",
    "PeerUnavailable",
    "RejectedContribution",
    "RejectedInput",
    "RetryableError",
    "RoundAborted",
    "lone_exception",
    "unwrap_lone",
]


class AtollError(Exception):
    """Root of every error atoll raises on purpose."""


class ConfigError(AtollError, ValueError):
    """A setting or argument is invalid; the message says which and why."""


class RetryableError(AtollError):
    """A transient failure: the same operation may succeed later or with another peer."""


class PeerUnavailable(RetryableError):
    """A peer could not be reached, or disappeared during a round."""


class PeerTimedOut(PeerUnavailable):
    """A peer did not answer within a bound (a dial, a Hello, a send): it is silent or
    too slow, not reset, so trying again at once only waits out the same bound."""


class ExchangeTimeout(RetryableError):
    """A bounded network wait ran out before its result arrived."""


class RoundAborted(RetryableError):
    """An averaging round ended without a result; nothing of it was applied."""


class RejectedInput(AtollError):
    """Input that must not be used: malformed, inconsistent or hostile."""


class CodecError(RejectedInput, ValueError):
    """Bytes that do not decode as the agreed codec, or values a codec refuses (NaN, inf)."""


class RejectedContribution(RejectedInput):
    """A peer's contribution failed validation and was left out of the reduction."""


def lone_exception(
    group: BaseExceptionGroup[BaseException], *, keep_grouped: tuple[type[BaseException], ...] = ()
) -> BaseException | None:
    """The single exception inside ``group`` (through nested groups), or None.

    Structured concurrency wraps one failure in a group per nursery it crosses; a caller
    that knows only one thing went wrong re-raises it bare so its own callers can catch the
    type. None when there are several leaves or the leaf is one of ``keep_grouped`` (a
    cancellation must reach its cancel scope as the event loop delivered it).
    """
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        e = pending.pop()
        if isinstance(e, BaseExceptionGroup):
            pending.extend(e.exceptions)
        else:
            leaves.append(e)
    if len(leaves) != 1 or isinstance(leaves[0], keep_grouped):
        return None
    return leaves[0]


@contextlib.contextmanager
def unwrap_lone(*, keep_grouped: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Around a block of nurseries: a lone exception leaves it as it was raised, not
    wrapped in one group per nursery (:func:`lone_exception`; several stay grouped, and so
    does one of ``keep_grouped``)."""
    try:
        yield
    except BaseExceptionGroup as group:
        lone = lone_exception(group, keep_grouped=keep_grouped)
        if lone is None:
            raise
        raise lone from None
