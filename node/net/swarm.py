"""The swarm worker: the network process of a node that trains with other peers.

:func:`swarm_worker` plugs into :class:`~atoll.node.net.bridge.NetworkBridge` like the
loopback worker, but its exchange is the swarm. It runs, in one trio loop:

- one libp2p host (:func:`~atoll.node.net.host.open_host`, Noise and yamux only) and
  atoll's Kademlia DHT on it (:class:`~atoll.dht.kad.AtollDHT`), joined through the
  ``--join`` addresses with retries and backoff (:func:`join_swarm` says why a join
  failed: unreachable, another run, another protocol version);
- the :class:`~atoll.protocol.engine.OuterEngine` over the fragments in shared memory;
- a :class:`~atoll.node.net.rounds.Mailbox` routing peers' messages to the rounds,
  and a state server answering :class:`~atoll.protocol.statesync.StateRequest`;
- a publisher of this peer's :class:`~atoll.dht.records.PeerRecord` (addresses,
  versions and digests per fragment, tokens/s), refreshed before it expires;
- status for the trainer's display, every second (:func:`~atoll.node.net.bridge.post_info`).

One sync of fragment ``p`` started at inner step ``t`` (the handler):

1. the engine encodes Δp against the global copy (version ``v``, digest ``d``);
2. if the live peers' records already show that the swarm's leading state of ``p``
   (:func:`~atoll.protocol.statesync.leading_state`) is not this peer's, it rebases at
   once (step 5) instead of looking for a group;
3. matchmaking at slot ``v`` (:func:`~atoll.node.net.rounds.run_matchmaking`): a ready
   record in the DHT, a group among peers of equal ``(v, d)``, or Alone. The slot is the
   fragment's *version*, not a step count: peers of different speeds that hold the same
   global copy meet at the same slot (a faster one waits in the network process, up to
   ``matchmaking_s``, while its trainer goes on), and a peer that missed a round rebases
   and meets the others at the next version;
4. a formed group runs the all-reduce (:func:`~atoll.node.net.rounds.run_allreduce`)
   under the key ``(run, p, v)``; Done is delivered to the engine and the new global
   copy written to shared memory; Alone or Failed skips the round (nothing applied);
5. if the slot's declarations or the live records show the leading state elsewhere, the
   peer rebases: it fetches that state from a peer that holds it, and the outcome carries
   the new global copy (``applied=True``, reason ``rebased ...``), merged by the trainer.

At start, before reporting ready, a peer catches up: it reads the peers' records and
rebases every fragment whose leading state is not its own, and tells the trainer the
inner step to start from (``start_step`` in the bridge's ``info``), so that a late
joiner's slots line up with the swarm's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import trio

from atoll.dht.kad import AtollDHT
from atoll.dht.records import PeerRecord
from atoll.dht.status import serve_status
from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier, SystemClock
from atoll.node.net.bridge import SharedFragments, SyncOutcome, post_info, serve
from atoll.node.net.host import (
    AGENT,
    AtollHost,
    HostConfig,
    VersionMismatch,
    WrongRun,
    open_host,
)
from atoll.node.net.rounds import (
    Mailbox,
    RoundTraffic,
    fetch_state,
    run_allreduce,
    run_matchmaking,
    serve_state,
)
from atoll.protocol import allreduce as ar
from atoll.protocol import matchmaking as mm
from atoll.protocol import statesync as ss
from atoll.protocol.engine import OuterEngine
from atoll.protocol.errors import AtollError, ConfigError, PeerUnavailable
from atoll.protocol.manifest import GroupSettings, RunManifest
from atoll.protocol.schedule import Schedule
from atoll.security.identity import load_or_create

__all__ = ["JoinFailed", "SwarmStats", "join_swarm", "swarm_worker"]

logger = logging.getLogger(__name__)

_RECORD_TTL_S = 120.0  # lifetime of a published peer record; refreshed at a third of it
_READY_TTL_SLACK_S = 10.0  # a ready record lives 2 x matchmaking_s plus this
_INFO_EVERY_S = 1.0
_PEERS_EVERY_S = 5.0  # how often the live peers of the run are read from the DHT
_REPUBLISH_MIN_S = 2.0  # a changed peer record goes out at most this often
_HISTORY = 200  # (fragment, version, digest) entries kept for the info


class JoinFailed(PeerUnavailable):
    """No ``--join`` address let this node into the swarm; the message says why, per address."""


@dataclass(slots=True)
class SwarmStats:
    """Counters of the network process, sent to the trainer as ``info``."""

    rounds_applied: int = 0
    rounds_failed: int = 0
    rounds_alone: int = 0
    rebases: int = 0
    last_sync: dict[int, str] = field(default_factory=dict)
    round_s: list[float] = field(default_factory=list)
    round_bytes: list[int] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    outcomes: list[tuple[int, int, str, float, bool]] = field(default_factory=list)
    """(fragment, version, round status, seconds, rebased) of every sync: the status of the
    round at that version (applied, failed, alone, or none when the peer rebased without
    looking for a group), and whether the sync ended with a rebase"""
    history: list[tuple[int, int, str, str]] = field(default_factory=list)
    """(fragment, version, digest, round) after every applied round and rebase; round is
    ``"slot/leader"`` of the group (members of one group must hold the same digest), or
    ``"rebase"``"""


# --------------------------------------------------------------------------------------
# joining
# --------------------------------------------------------------------------------------
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
            ok = await dht.bootstrap([addr]) > 0
            reason = await _probe(host, addr, dial_s)
            if reason is not None and reason.startswith("fatal:"):
                fatal += 1
                reasons[addr] = reason.removeprefix("fatal:")
                continue
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


async def _probe(host: AtollHost, addr: str, dial_s: float) -> str | None:
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


# --------------------------------------------------------------------------------------
# the worker
# --------------------------------------------------------------------------------------
class _Swarm:
    """The state of one node's network process (see the module docstring)."""

    def __init__(
        self,
        shared: SharedFragments,
        outbox: Connection,
        manifest: RunManifest,
        host: AtollHost,
        dht: AtollDHT,
        engine: OuterEngine,
        poll_s: float,
    ) -> None:
        self.shared = shared
        self.outbox = outbox
        self.manifest = manifest
        self.run_id = manifest.run_id()
        self.host = host
        self.dht = dht
        self.engine = engine
        self.poll_s = poll_s
        self.lock = trio.Lock()  # one engine call at a time
        self.stats = SwarmStats()
        self.mailbox = Mailbox(host, on_request=self.on_request, hold_s=manifest.timeouts.round_s)
        self.seen_tokens = 0
        self.step = 0
        self.swarm_step = 0  # the newest step of a peer whose state this peer copied
        self._round_status: dict[int, str] = {}
        self.tokens_per_s = 0.0
        self._rate_mark = (time.monotonic(), 0)
        self.peers_seen: set[str] = set()
        self._published: tuple[tuple[int, ...], tuple[str, ...], float] = ((), (), 0.0)
        self.live: dict[str, PeerRecord] = {}  # peers of the run with a live record
        self.background: trio.Nursery | None = None  # where sends finish (rounds.py)

    # -- state server ------------------------------------------------------------------
    async def on_request(self, sender: str, msg: object) -> None:
        if not isinstance(msg, ss.StateRequest):
            logger.info("peer %s sent an unexpected %s", sender, type(msg).__name__)
            return
        if msg.run_id != self.run_id or not 0 <= msg.fragment < len(self.shared):
            await serve_state(self.host, sender, msg, None, "no such run or fragment")
            return
        async with self.lock:
            state = await trio.to_thread.run_sync(
                self.engine.export_fragment, msg.fragment, self.step
            )
        await serve_state(self.host, sender, msg, state)

    async def rebase(self, p: int, holders: Sequence[str], target: tuple[int, str]) -> int | None:
        """Copy fragment ``p``'s ``target`` state from one of ``holders``; its step or None."""
        numel = self.shared.sizes[p]
        for peer in holders:
            try:
                state = await fetch_state(
                    self.host,
                    self.mailbox,
                    peer,
                    self.run_id,
                    p,
                    numel,
                    timeout_s=self.manifest.timeouts.round_s,
                )
            except AtollError as e:
                logger.info("fetching fragment %d from %s failed: %s", p, peer, e)
                continue
            if state.version < target[0]:
                logger.info("peer %s served fragment %d at an older version", peer, p)
                continue
            async with self.lock:
                self.engine.import_fragment(p, state)
                self.shared.global_(p)[:] = self.engine.global_params(p)
                self._remember(p, "rebase")
            self.stats.rebases += 1
            logger.info(
                "fragment %d rebased to version %d (%s) from %s",
                p,
                state.version,
                state.digest(),
                peer,
            )
            self.swarm_step = max(self.swarm_step, state.step)
            return state.step
        return None

    async def catch_up(self) -> int:
        """Rebase every fragment that the peers' records show behind; the step to start at."""
        try:
            records = await self.dht.find_peers()
        except AtollError as e:
            logger.info("no peer records yet (%s): starting from the manifest's seed", e)
            return 0
        self.note_peers(records)
        start = 0
        for p in range(len(self.shared)):
            step = await self._rebase_if_led(p, self._live_holdings(p))
            if step is not None:
                start = max(start, step)
        return start

    async def _rebase_if_led(self, p: int, holdings: list[tuple[str, int, str]]) -> int | None:
        """Copy fragment ``p``'s leading state when ``holdings`` (peer, version, digest)
        show it is not this peer's; the serving peer's step, or None (no rebase)."""
        mine = (self.engine.version(p), await trio.to_thread.run_sync(self.engine.digest, p))
        if not ss.should_rebase(self.host.peer_id, mine, holdings):
            return None
        target = ss.leading_state([*holdings, (self.host.peer_id, *mine)])
        assert target is not None
        holders = [peer for peer, v, d in holdings if (v, d) == target]
        return await self.rebase(p, holders, target)

    # -- one sync -------------------------------------------------------------------------
    async def handle(self, p: int, step: int, tokens: int) -> SyncOutcome:
        """One sync of fragment ``p`` started at ``step`` (see the module docstring)."""
        t0 = trio.current_time()
        self._round_status[p] = "none"  # no round: rebased before looking for a group
        outcome = await self._sync(p, step, tokens)
        entry = (
            p,
            outcome.round,
            self._round_status[p],
            round(trio.current_time() - t0, 3),
            outcome.reason.startswith("rebased"),
        )
        self.stats.outcomes = [*self.stats.outcomes[-_HISTORY + 1 :], entry]
        return outcome

    def _live_holdings(self, p: int) -> list[tuple[str, int, str]]:
        """(peer, version, digest) of fragment ``p`` from the live peers' records."""
        return [
            (r.peer_id, r.versions[p], r.digests[p])
            for r in self.live.values()
            if len(r.versions) > p and len(r.digests) > p and r.digests[p]
        ]

    async def _maybe_rebase(
        self, p: int, step: int, round_: int, holdings: list[tuple[str, int, str]]
    ) -> SyncOutcome | None:
        """Rebase fragment ``p`` when ``holdings`` show the swarm leads elsewhere; the
        outcome of the sync then, or None when this peer holds the leading state."""
        if await self._rebase_if_led(p, holdings) is None:
            return None
        version = self.engine.version(p)
        self.stats.last_sync[p] = f"rebased v{version}"
        # before the outcome, on the same pipe: the trainer may jump to the swarm's step
        post_info(self.outbox, {"swarm_step": self.swarm_step})
        return SyncOutcome(p, step, True, round_, f"rebased to version {version}")

    async def _sync(self, p: int, step: int, tokens: int) -> SyncOutcome:
        manifest = self.manifest
        self.step = max(self.step, step)
        async with self.lock:
            if tokens > self.seen_tokens:
                self.engine.add_tokens(tokens - self.seen_tokens)
                self.seen_tokens = tokens
            request = await trio.to_thread.run_sync(
                self.engine.begin, p, self.shared.local(p), step
            )
            digest = await trio.to_thread.run_sync(self.engine.digest, p)
        # peers known to be ahead: copy their state instead of looking for a group
        try:
            rebased = await self._maybe_rebase(p, step, request.round, self._live_holdings(p))
        except BaseException:
            self.engine.skip(p, "cancelled")
            raise
        if rebased is not None:
            return rebased
        # the rendezvous of a round is the fragment's version, not the step: peers of
        # different speeds that hold the same global copy meet at the same slot
        slot = request.round
        me = mm.Declaration(
            self.run_id,
            p,
            slot,
            self.host.peer_id,
            request.round,
            digest,
            request.weight,
            time.time(),
        )
        views: dict[str, tuple[int, str]] = {}

        def on_view(decls: list[mm.Declaration]) -> None:
            for d in decls:
                if d.peer_id != self.host.peer_id:
                    views[d.peer_id] = (d.version, d.digest)
                    self.peers_seen.add(d.peer_id)

        outcome: SyncOutcome
        try:
            found = await run_matchmaking(
                self.host,
                self.mailbox,
                self.dht,
                me,
                self.group_settings(),
                timeout_s=manifest.timeouts.matchmaking_s,
                ttl_s=2 * manifest.timeouts.matchmaking_s + _READY_TTL_SLACK_S,
                wall=time.time,
                poll_s=self.poll_s,
                view=on_view,
                background=self.background,
            )
            if isinstance(found, mm.Alone):
                self.stats.rounds_alone += 1
                outcome = await self._skip(p, step, request.round, f"alone: {found.reason}")
            else:
                outcome = await self._all_reduce(p, step, request, slot, found.members)
        except BaseException:
            self.engine.skip(p, "cancelled")
            raise
        self._round_status[p] = "applied" if outcome.applied else outcome.reason.split(":")[0]
        holdings = [(peer, v, d) for peer, (v, d) in views.items()]
        logger.info(
            "fragment %d slot %d: %s; the slot's declarations: %s",
            p,
            slot,
            outcome.reason or "applied",
            ", ".join(f"{peer[-6:]} v{v} {d[:6]}" for peer, v, d in holdings) or "none",
        )
        live = {peer: (peer, v, d) for peer, v, d in self._live_holdings(p)}
        live.update((peer, (peer, v, d)) for peer, v, d in holdings)
        rebased = await self._maybe_rebase(p, step, request.round, list(live.values()))
        return rebased if rebased is not None else outcome

    async def _skip(self, p: int, step: int, round_: int, reason: str) -> SyncOutcome:
        async with self.lock:
            self.engine.skip(p, reason)
        self.stats.last_sync[p] = reason.split(":")[0]
        return SyncOutcome(p, step, False, round_, reason)

    async def _all_reduce(
        self, p: int, step: int, request: Any, slot: int, members: tuple[str, ...]
    ) -> SyncOutcome:
        manifest = self.manifest
        spec = ar.RoundSpec(
            ar.RoundKey(self.run_id, p, slot),
            members,
            request.numel,
            manifest.codec,
            manifest.codec_block,
        )
        traffic = RoundTraffic()
        result = await run_allreduce(
            self.host,
            self.mailbox,
            spec,
            request.payload,
            request.weight,
            phase_timeout_s=manifest.timeouts.part_s,
            round_timeout_s=manifest.timeouts.round_s,
            traffic=traffic,
            checkpoint=self.fault(p, slot),
            background=self.background,
        )
        self.stats.round_s.append(round(traffic.seconds, 3))
        self.stats.round_bytes.append(traffic.bytes_sent)
        self.stats.group_sizes.append(len(members))
        if isinstance(result, ar.Failed):
            self.stats.rounds_failed += 1
            return await self._skip(p, step, request.round, f"failed: {result.reason}")
        async with self.lock:
            try:
                await trio.to_thread.run_sync(
                    self.engine.deliver, p, result.averaged, request.round
                )
            except AtollError as e:
                self.stats.rounds_failed += 1
                self.engine.skip(p, str(e))
                return SyncOutcome(p, step, False, request.round, f"failed: {e}")
            self.shared.global_(p)[:] = self.engine.global_params(p)
            self._remember(p, f"{slot}/{members[0]}")
        self.stats.rounds_applied += 1
        self.stats.last_sync[p] = f"v{self.engine.version(p)} x{len(members)}"
        return SyncOutcome(p, step, True, request.round)

    def _remember(self, p: int, round_id: str) -> None:
        """Note fragment ``p``'s new (version, digest): tests compare them across peers."""
        entry = (p, self.engine.version(p), self.engine.digest(p), round_id)
        self.stats.history = [*self.stats.history[-_HISTORY + 1 :], entry]

    def fault(self, p: int, slot: int) -> Callable[[str], None] | None:
        """The fault-injection hook of ``ATOLL_FAULT=kill:POINT:FRAGMENT:SLOT`` (tests):
        the network process kills itself with SIGKILL at that point of that round."""
        spec = os.environ.get("ATOLL_FAULT", "")
        parts = spec.split(":")
        if len(parts) != 4 or parts[0] != "kill" or parts[2:] != [str(p), str(slot)]:
            return None
        point = parts[1]

        def hook(at: str) -> None:
            if at == point:
                logger.warning("ATOLL_FAULT: killing the network process at %s", at)
                os.kill(os.getpid(), signal.SIGKILL)

        return hook

    # -- background ---------------------------------------------------------------------
    def peer_record(self) -> PeerRecord:
        now = time.time()
        return PeerRecord(
            self.host.peer_id,
            self.run_id,
            tuple(a.rsplit("/p2p/", 1)[0] for a in self.host.addrs)[:8],
            AGENT,
            float(self.tokens_per_s),
            tuple(self.engine.version(p) for p in range(len(self.shared))),
            tuple(self.engine.digest(p) for p in range(len(self.shared))),
            True,
            now,
            now + _RECORD_TTL_S,
        )

    async def publish_once(self) -> None:
        async with self.lock:
            record = await trio.to_thread.run_sync(self.peer_record)
        try:
            await self.dht.announce_peer(record)
            self._published = (record.versions, record.digests, time.monotonic())
        except AtollError as e:
            logger.info("publishing the peer record failed: %s", e)

    async def publish(self) -> None:
        """Keep this peer's record fresh: republished when a fragment's version changed
        (at most every :data:`_REPUBLISH_MIN_S`) and before it expires."""
        while True:
            await trio.sleep(_REPUBLISH_MIN_S)
            versions, _, at = self._published
            current = tuple(self.engine.version(p) for p in range(len(self.shared)))
            if current != versions or time.monotonic() - at > _RECORD_TTL_S / 3:
                await self.publish_once()

    def note_peers(self, records: Sequence[PeerRecord]) -> None:
        """Take in the peer records of the run (the live set sizes the groups)."""
        now = time.time()
        for r in records:
            held = self.live.get(r.peer_id)
            if r.peer_id != self.host.peer_id and (held is None or r.issued_at >= held.issued_at):
                self.live[r.peer_id] = r
                self.peers_seen.add(r.peer_id)
                self.host.add_addrs(r.peer_id, r.addrs, ttl_s=r.expires_at - now)
        self.live = {p: r for p, r in self.live.items() if r.expires_at > now}

    async def watch_peers(self) -> None:
        """Refresh the set of live peers from the DHT every :data:`_PEERS_EVERY_S`."""
        while True:
            try:
                self.note_peers(await self.dht.find_peers())
            except AtollError as e:
                logger.debug("find_peers: %s", e)
            await trio.sleep(_PEERS_EVERY_S)

    def group_settings(self) -> GroupSettings:
        """The manifest's group settings, the most members capped at the live peers known:
        once every peer known alive has joined, the leader need not wait out the grace."""
        group = self.manifest.group
        if not self.live:
            return group
        size = max(group.min_quorum, min(group.max_size, 1 + len(self.live)))
        return dataclasses.replace(group, max_size=size)

    async def wait_for_peers(self, n: int, timeout_s: float) -> None:
        """Wait until ``n`` other peers of the run have published their records."""
        seen: set[str] = set()
        with trio.move_on_after(timeout_s):
            while True:
                try:
                    records = await self.dht.find_peers()
                    self.note_peers(records)
                    seen = {r.peer_id for r in records} - {self.host.peer_id}
                except AtollError as e:
                    logger.debug("find_peers: %s", e)
                self.peers_seen.update(seen)
                if len(seen) >= n:
                    logger.info("%d peers of the run are here; training starts", len(seen))
                    return
                await trio.sleep(0.5)
        raise JoinFailed(f"only {len(seen)} of the {n} peers waited for appeared in {timeout_s} s")

    def info(self) -> dict[str, Any]:
        now = time.monotonic()
        t0, tok0 = self._rate_mark
        if now - t0 >= 5.0:
            self.tokens_per_s = (self.seen_tokens - tok0) / (now - t0)
            self._rate_mark = (now, self.seen_tokens)
        s = self.stats
        return {
            "peer_id": self.host.peer_id,
            "peers_seen": len(self.peers_seen),
            "dht_peers": len(self.dht.routing_table_peers()),
            "bytes_per_peer": {
                peer: [self.host.bytes_sent.get(peer, 0), self.host.bytes_received.get(peer, 0)]
                for peer in list(self.host.bytes_sent)[:64]
            },
            "bytes_up": sum(self.host.bytes_sent.values()),
            "bytes_down": sum(self.host.bytes_received.values()),
            "rounds_applied": s.rounds_applied,
            "rounds_failed": s.rounds_failed,
            "rounds_alone": s.rounds_alone,
            "rebases": s.rebases,
            "last_sync": {str(k): v for k, v in s.last_sync.items()},
            "round_s": s.round_s[-50:],
            "round_bytes": s.round_bytes[-50:],
            "group_sizes": s.group_sizes[-50:],
            "versions": [self.engine.version(p) for p in range(len(self.shared))],
            "history": s.history,
            "outcomes": s.outcomes,
        }

    async def report(self) -> None:
        while True:
            post_info(self.outbox, self.info())
            await trio.sleep(_INFO_EVERY_S)


async def swarm_worker(
    shared: SharedFragments,
    inbox: Connection,
    outbox: Connection,
    *,
    manifest: RunManifest,
    identity_file: str,
    join: Sequence[str] = (),
    listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    join_timeout_s: float = 60.0,
    dht_timeout_s: float = 10.0,
    poll_s: float = 0.5,
    seed: int = 0,
    wait_peers: int = 0,
) -> None:
    """The network process of a swarm node (see the module docstring).

    ``shared`` holds the initial global copies (written by the trainer). Before reporting
    ready it joins the swarm and catches up; ``info`` then carries ``start_step``,
    ``peer_id`` and ``addrs``.
    """
    if manifest.aggregation != "mean":
        raise ConfigError(
            f"aggregation {manifest.aggregation!r} runs in the simulator only; the swarm "
            "averages with 'mean'"
        )
    identity = load_or_create(identity_file)
    config = manifest.engine_config()
    engine = OuterEngine(
        config,
        Schedule(config.H, len(shared)),
        [shared.global_(p).copy() for p in range(len(shared))],
        seed=seed,
    )
    run_id = manifest.run_id()
    host_config = HostConfig(listen=tuple(listen), dial_timeout_s=manifest.timeouts.dial_s)
    async with (
        open_host(identity, run_id, host_config) as host,
        AtollDHT.start(
            host.libp2p_host,
            run_id=run_id,
            verifier=EnvelopeVerifier(),
            signer=EnvelopeSigner(identity),
            clock=SystemClock(),
            timeout_s=dht_timeout_s,
        ) as dht,
        trio.open_nursery() as nursery,
    ):
        serve_status(host.libp2p_host, dht.value_store)
        swarm = _Swarm(shared, outbox, manifest, host, dht, engine, poll_s)
        swarm.background = nursery
        nursery.start_soon(swarm.mailbox.run)
        joined = await join_swarm(
            host, dht, join, timeout_s=join_timeout_s, dial_s=manifest.timeouts.dial_s
        )
        await swarm.publish_once()
        if wait_peers:
            await swarm.wait_for_peers(wait_peers, join_timeout_s)
        start_step = await swarm.catch_up() if joined else 0
        swarm.step = start_step
        post_info(
            outbox,
            {
                "start_step": start_step,
                "peer_id": host.peer_id,
                "addrs": host.addrs,
                "run_id": run_id,
                "joined": joined,
            },
        )
        nursery.start_soon(swarm.publish)
        nursery.start_soon(swarm.watch_peers)
        nursery.start_soon(swarm.report)
        await serve(inbox, outbox, swarm.handle)
        post_info(outbox, swarm.info())
        nursery.cancel_scope.cancel()
