"""Fault injection for tests: kill or freeze the network process at an exact point of a
round.

A spec ``kill:POINT:FRAGMENT:SLOT`` (``atoll node``'s ``fault`` setting, e.g. from the
``ATOLL_FAULT`` variable) makes the node's network process kill itself with SIGKILL when
the all-reduce of that fragment's first round at or after ``SLOT`` reaches ``POINT``:
``start`` (before its first part goes out), ``part_sent`` (one part written) or
``parts_sent`` (every part written). A node runs no all-reduce at a slot it spends alone
or rebasing, so the first round it runs is the one that counts; the warning it logs
names the slot. A fifth field, ``ACTION:POINT:FRAGMENT:SLOT:MEMBERS``, reaches only a
round of at least ``MEMBERS`` members (a benchmark that must freeze a round the other
nodes are in asks for all of them). The integration tests use it to check that the
survivors of a round fail it whole. ``stop:...`` freezes the process with SIGSTOP
instead: its connections stay open and its kernel still acknowledges what arrives, but
nothing answers, as with a peer whose link went silent (the test or benchmark that set it kills
the frozen process when it is done with it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from atoll.protocol.errors import ConfigError

__all__ = ["POINTS", "descendants", "parse_fault"]

logger = logging.getLogger(__name__)

POINTS = ("start", "part_sent", "parts_sent")
ACTIONS = {"kill": ("killing", signal.SIGKILL), "stop": ("freezing (SIGSTOP)", signal.SIGSTOP)}


def parse_fault(
    spec: str,
) -> Callable[[int, int, int], Callable[[str], None] | None] | None:
    """The fault hook of ``spec`` (None for an empty spec); ConfigError when malformed.

    The hook maps ``(fragment, slot, members)`` to the round's checkpoint callback, or None
    for the rounds the spec does not reach (another fragment, an earlier slot, a smaller
    group).
    """
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (4, 5) or parts[0] not in ACTIONS or parts[1] not in POINTS:
        raise ConfigError(
            f"fault must be ACTION:POINT:FRAGMENT:SLOT[:MEMBERS] with ACTION in"
            f" {tuple(ACTIONS)} and POINT in {POINTS}"
        )
    try:
        fragment, slot = int(parts[2]), int(parts[3])
        least = int(parts[4]) if len(parts) == 5 else 0
    except ValueError:
        raise ConfigError(f"fault {spec!r}: FRAGMENT, SLOT and MEMBERS must be integers") from None
    point = parts[1]
    doing, sig = ACTIONS[parts[0]]

    fired: list[int] = []  # a process continued after a stop is not stopped again

    def for_round(p: int, s: int, members: int) -> Callable[[str], None] | None:
        if p != fragment or s < slot or members < least or fired:
            return None

        def hook(at: str) -> None:
            if at == point and not fired:
                fired.append(s)
                logger.warning(
                    "fault injection: fragment %d slot %d (%d members): %s the network"
                    " process at %s",
                    p,
                    s,
                    members,
                    doing,
                    at,
                )
                for handler in logging.getLogger().handlers:
                    handler.flush()  # the line is out before the process stops
                os.kill(os.getpid(), sig)

        return hook

    return for_round


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (its children, then theirs), read from Linux's
    ``/proc``: a node frozen by ``stop:`` is its daemon's network child, and whoever ends
    the run must kill the frozen process itself (a stopped process ignores SIGTERM)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out
