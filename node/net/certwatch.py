"""Certificates looked up ahead of the syncs that need them.

A node believes a peer's state of a fragment only with its certificate
(:mod:`atoll.protocol.certificate`), and :meth:`~atoll.node.net.syncer.Syncer.certify`
looks certificates up when the fragment syncs. After a split heals, the two sides hold
states the other side has never seen certified, and a lookup made only at each
fragment's sync costs up to a sync period before the rebase rule can even compare the
sides' copies. :func:`watch_certificates` makes the same lookups in the background every
few seconds, for every fragment: by the time a fragment syncs, the states its peers
declare are already believed (or known to have no certificate). A swarm whose states are
all believed looks nothing up (``certify`` asks only for unbelieved states, a few at a
time, and waits before asking again after a lookup that found nothing).

Right after each fragment's lookups, the watcher asks for the state that fragment's next
sync would rebase onto to be copied ahead (:meth:`~atoll.node.net.syncer.Syncer.
prefetch`, in the background, one copy per fragment at a time): a node behind then imports
it at its sync at once and meets the swarm at its slot, instead of copying it while the
swarm's group forms without it.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from atoll.protocol.errors import AtollError

__all__ = ["Certifier", "watch_certificates"]

logger = logging.getLogger(__name__)


class Certifier(Protocol):
    """What the watcher needs: :meth:`Syncer.certify` and :meth:`Syncer.prefetch`."""

    async def certify(self, p: int) -> tuple[int, str]: ...

    async def prefetch(self, p: int) -> bool: ...


async def watch_certificates(certifier: Certifier, fragments: int, every_s: float) -> None:
    """Every ``every_s`` seconds, look up the certificates of the states the peers declare
    for each of the ``fragments`` that this node does not believe yet, and copy ahead the
    states their syncs would rebase onto; forever."""
    async with trio.open_nursery() as copies:
        while True:
            for p in range(fragments):
                try:
                    await certifier.certify(p)
                except AtollError as e:  # a lookup that failed is retried at the next turn
                    logger.debug("fragment %d: certificate lookup: %s", p, e)
                copies.start_soon(_prefetch, certifier, p)
            await trio.sleep(every_s)


async def _prefetch(certifier: Certifier, p: int) -> None:
    try:
        await certifier.prefetch(p)
    except AtollError as e:  # tried again at the next turn
        logger.debug("fragment %d: copy ahead of its sync: %s", p, e)
