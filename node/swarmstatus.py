"""``atoll status``: the swarm as a DHT peer sees it (peers, runs, versions).

Asks one or more peers (``--join`` addresses: bootstrap peers or nodes) for the peer
records they store (:mod:`atoll.dht.status`), validates every record here, merges the
answers (the newest record of each peer wins) and prints them grouped by run. With
``--run MANIFEST`` only that run is shown, under its name. Runs on a bare, throwaway
libp2p host (a fresh identity, Noise only); imports no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from atoll.dht.records import PeerRecord
from atoll.dht.status import fetch_status
from atoll.node.envelopes import EnvelopeVerifier, SystemClock
from atoll.node.net.host import HostConfig, open_libp2p_host
from atoll.protocol.errors import AtollError, PeerUnavailable
from atoll.security.identity import generate

__all__ = ["SwarmView", "format_view", "query"]

logger = logging.getLogger(__name__)


@dataclass
class SwarmView:
    """What the asked peers know: the newest valid record of every peer, and who answered."""

    records: list[PeerRecord]
    answered: list[str]
    failed: dict[str, str]


def query(addrs: Sequence[str], *, timeout_s: float = 10.0) -> SwarmView:
    """Ask every address in ``addrs``; PeerUnavailable when none answered."""

    async def main() -> SwarmView:
        config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), dial_timeout_s=timeout_s)
        newest: dict[str, PeerRecord] = {}
        answered: list[str] = []
        failed: dict[str, str] = {}
        async with open_libp2p_host(generate(), config) as host:
            for addr in addrs:
                try:
                    got = await fetch_status(
                        host,
                        addr,
                        verifier=EnvelopeVerifier(),
                        clock=SystemClock(),
                        timeout_s=timeout_s,
                    )
                except AtollError as e:
                    failed[addr] = str(e)
                    continue
                answered.append(addr)
                for r in got:
                    held = newest.get(r.peer_id)
                    if held is None or r.issued_at > held.issued_at:
                        newest[r.peer_id] = r
        records = sorted(newest.values(), key=lambda r: (r.run_id, r.peer_id))
        return SwarmView(records, answered, failed)

    view = trio.run(main)
    if not view.answered:
        raise PeerUnavailable(f"no peer answered: {'; '.join(view.failed.values())}")
    return view


def format_view(view: SwarmView, *, run_id: str | None = None, run_name: str = "") -> str:
    """The records as a table per run (only ``run_id``'s when given)."""
    now = time.time()
    runs: dict[str, list[PeerRecord]] = {}
    for r in view.records:
        if run_id is None or r.run_id == run_id:
            runs.setdefault(r.run_id, []).append(r)
    lines = [f"asked: {', '.join(view.answered)}"]
    lines += [f"no answer from {a}: {why}" for a, why in view.failed.items()]
    if not runs:
        lines.append(
            "no peers of that run in the DHT" if run_id else "no peers of any run in the DHT"
        )
    for rid, records in runs.items():
        name = f" ({run_name})" if run_name and rid == run_id else ""
        lines.append(f"\nrun {rid[:16]}{name}: {len(records)} peer(s)")
        lines.append(
            f"  {'peer':<20}{'tok/s':>9}{'age s':>7}  {'versions':<22}{'reach':<9}{'agent':<16}"
            "addresses"
        )
        for r in records:
            versions = ",".join(str(v) for v in r.versions) or "-"
            lines.append(
                f"  {r.peer_id[:8] + '..' + r.peer_id[-8:]:<20}{r.tokens_per_s:>9.0f}"
                f"{now - r.issued_at:>7.0f}  {versions:<22}{r.reach or '-':<9}{r.agent:<16}"
                f"{' '.join(r.addrs)}"
            )
    return "\n".join(lines)
