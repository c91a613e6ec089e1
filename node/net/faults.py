"""Fault injection for tests: kill the network process at an exact point of a round.

A spec ``kill:POINT:FRAGMENT:SLOT`` (``atoll node``'s ``fault`` setting, e.g. from the
``ATOLL_FAULT`` variable) makes the node's network process kill itself with SIGKILL when
the all-reduce of that fragment's first round at or after ``SLOT`` reaches ``POINT``:
``start`` (before its first part goes out), ``part_sent`` (one part written) or
``parts_sent`` (every part written). A node runs no all-reduce at a slot it spends alone
or rebasing, so the first round it runs is the one that counts; the warning it logs
names the slot. The integration tests use it to check that the survivors of a round
fail it whole.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from atoll.protocol.errors import ConfigError

__all__ = ["POINTS", "parse_fault"]

logger = logging.getLogger(__name__)

POINTS = ("start", "part_sent", "parts_sent")


def parse_fault(spec: str) -> Callable[[int, int], Callable[[str], None] | None] | None:
    """The fault hook of ``spec`` (None for an empty spec); ConfigError when malformed.

    The hook maps ``(fragment, slot)`` to the round's checkpoint callback, or None for the
    rounds the spec does not reach (another fragment, an earlier slot).
    """
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 4 or parts[0] != "kill" or parts[1] not in POINTS:
        raise ConfigError(f"fault must be kill:POINT:FRAGMENT:SLOT with POINT in {POINTS}")
    try:
        fragment, slot = int(parts[2]), int(parts[3])
    except ValueError:
        raise ConfigError(f"fault {spec!r}: FRAGMENT and SLOT must be integers") from None
    point = parts[1]

    def for_round(p: int, s: int) -> Callable[[str], None] | None:
        if p != fragment or s < slot:
            return None

        def hook(at: str) -> None:
            if at == point:
                logger.warning(
                    "fault injection: fragment %d slot %d: killing the network process at %s",
                    p,
                    s,
                    at,
                )
                os.kill(os.getpid(), signal.SIGKILL)

        return hook

    return for_round
