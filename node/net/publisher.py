"""Keeping this peer's record in the DHT fresh.

:class:`RecordPublisher` announces the node's :class:`~atoll.dht.records.PeerRecord`
(addresses, per-fragment versions and digests, tokens/s) once at start, again within
``min_gap_s`` of a change of any fragment's version (or of the trainer's step by a
period), and before the record expires (at a third of its lifetime). A failed announce
is logged and retried at the next turn: the peers' view of this node is eventually
right, never blocking a sync.

:class:`AttestationPublisher` does the same for this member's attestations of committed
rounds (:class:`~atoll.protocol.certificate.Attestation`): :meth:`~AttestationPublisher.
submit` seals one at once (the syncer calls it right after a commit; it never waits) and
the publisher's task puts it in the DHT as an
:class:`~atoll.dht.records.AttestationRecord` under (fragment, version, this peer),
retrying a failed announce every ``retry_s``, and republishing the attestation of the
state it still holds before its record expires (at a third of its lifetime), so that a
joiner can check the state long after its round. One attestation per fragment is kept:
memory is bounded by the fragments, and the queue of unpublished ones too.

:class:`EvidenceExchange` shares the proof of forged claims, so that a peer bans a forger
it never saw forge (docs/DESIGN.md, "Strikes and bans"): when this node bans a peer for a
forged record, it fetches that record's sealed value (the forger's own signature on it)
and publishes it in its :class:`~atoll.dht.records.EvidenceRecord`; every few seconds it
reads the others' evidence and judges each claim itself: the forger's seal must open,
the claim must declare a state more than one version past everything this node believes,
and a certificate lookup of that state must find none. Only then is the forger struck
(``evidence``). The accuser is trusted for nothing: it can at most make the node check a
claim.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from atoll.dht.records import (
    MAX_CLAIM_BYTES,
    MAX_CLAIMS,
    MAX_TTL_S,
    AttestationRecord,
    EvidenceRecord,
    PeerRecord,
    RecordVerifier,
    RejectedRecord,
    open_claim,
)
from atoll.protocol.certificate import (
    Attestation,
    AttestationSigner,
    CertifiedStates,
    seal_attestation,
)
from atoll.protocol.errors import AtollError
from atoll.protocol.strikes import Ban, Strikes

__all__ = [
    "ATTESTATION_TTL_S",
    "RECORD_TTL_S",
    "AttestationBoard",
    "AttestationPublisher",
    "EvidenceBoard",
    "EvidenceExchange",
    "RecordPublisher",
]

logger = logging.getLogger(__name__)

RECORD_TTL_S = 120.0
"""lifetime of a published peer record; it is refreshed at a third of it"""


class PeerAnnouncer(Protocol):
    """What the publisher needs of the DHT."""

    async def announce_peer(self, record: PeerRecord, /) -> None: ...


class RecordPublisher:
    """Publishes the record ``make_record`` builds (see the module docstring)."""

    def __init__(
        self,
        dht: PeerAnnouncer,
        make_record: Callable[[], Awaitable[PeerRecord]],
        versions: Callable[[], tuple[int, ...]],
        *,
        ttl_s: float = RECORD_TTL_S,
        min_gap_s: float = 2.0,
    ) -> None:
        self.dht = dht
        self.make_record = make_record
        self.versions = versions
        self.ttl_s = ttl_s
        self.min_gap_s = min_gap_s
        self._published: tuple[int, ...] | None = None
        self._at = -float("inf")

    async def publish_once(self) -> bool:
        """Build and announce the record now; False when that failed (logged)."""
        mark = self.versions()
        record = await self.make_record()
        try:
            await self.dht.announce_peer(record)
        except AtollError as e:
            logger.info("publishing the peer record failed: %s", e)
            return False
        self._published = mark
        self._at = trio.current_time()
        return True

    async def publish_if_changed(self) -> bool:
        """Publish now when the state changed since the last record; False when that
        failed."""
        if self.versions() == self._published:
            return True
        return await self.publish_once()

    async def run(self) -> None:
        """Republish on a change (at most every ``min_gap_s``) and before expiry, forever."""
        while True:
            await trio.sleep(self.min_gap_s)
            stale = trio.current_time() - self._at > self.ttl_s / 3
            if self.versions() != self._published or stale:
                await self.publish_once()


ATTESTATION_TTL_S = MAX_TTL_S
"""lifetime of a published attestation record (the longest a record may live); the
attestation of a state still held is republished at a third of it"""


class AttestationBoard(Protocol):
    """Where attestations are published and found (the DHT, or the in-memory board)."""

    async def announce_attestation(self, record: AttestationRecord, /) -> None: ...

    async def find_attestations(
        self, fragment: int, version: int, /
    ) -> list[AttestationRecord]: ...


class AttestationPublisher:
    """Publishes this member's attestations (see the module docstring).

    ``held(p)`` is the ``(version, digest)`` of fragment ``p`` this node holds now: an
    attestation is republished only while it names that state. Times: ``wall`` stamps
    records (they expire on it); the retry and refresh periods run on trio's clock.
    """

    def __init__(
        self,
        board: AttestationBoard,
        signer: AttestationSigner,
        *,
        peer_id: str,
        wall: Callable[[], float],
        held: Callable[[int], tuple[int, str]] | None = None,
        ttl_s: float = ATTESTATION_TTL_S,
        retry_s: float = 2.0,
    ) -> None:
        self.board = board
        self.signer = signer
        self.peer_id = peer_id
        self.wall = wall
        self.held = held
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._latest: dict[int, tuple[Attestation, bytes, float]] = {}
        """per fragment: the newest attestation, its seal, when it was last published
        (-inf: not yet)"""
        self._wake = trio.Event()
        self.published = 0

    def submit(self, attestation: Attestation) -> None:
        """Seal ``attestation`` now and have it published soon (never waits)."""
        held = self._latest.get(attestation.fragment)
        if held is not None and held[0].version > attestation.version:
            return
        sealed = seal_attestation(attestation, self.signer)
        self._latest[attestation.fragment] = (attestation, sealed, -float("inf"))
        self._wake.set()

    def restore(self, attestation: Attestation, sealed: bytes) -> None:
        """Take back an attestation this node sealed before it stopped (a checkpoint
        kept it) and publish it again soon: the peers that look up the state this node
        resumed with find it, although the DHT lost it meanwhile."""
        held = self._latest.get(attestation.fragment)
        if held is not None and held[0].version >= attestation.version:
            return
        self._latest[attestation.fragment] = (attestation, sealed, -float("inf"))
        self._wake.set()

    def sealed(self, fragment: int) -> bytes | None:
        """The newest sealed attestation of ``fragment`` (to hand to a peer), or None."""
        held = self._latest.get(fragment)
        return None if held is None else held[1]

    def sealed_for(self, fragment: int, version: int, digest: str) -> bytes | None:
        """This node's sealed attestation of exactly that state (to answer a peer's
        :class:`~atoll.protocol.certificate.AttestationRequest`), or None."""
        held = self._latest.get(fragment)
        if held is None or (held[0].version, held[0].digest) != (version, digest):
            return None
        return held[1]

    def unpublished(self) -> list[int]:
        """The fragments whose newest attestation names the state held now and has not
        been published yet (a node about to leave waits for them: its peers may need
        them to certify the rounds they made together)."""
        return sorted(
            p
            for p, (attestation, _, at) in self._latest.items()
            if at == -float("inf") and self._still_held(attestation)
        )

    async def publish_due(self) -> None:
        """Publish every attestation not yet published, and republish those of states
        still held that are a third of their lifetime old."""
        now = trio.current_time()
        for p, (attestation, sealed, at) in list(self._latest.items()):
            fresh = now - at < self.ttl_s / 3
            if fresh or (at > -float("inf") and not self._still_held(attestation)):
                continue
            wall = self.wall()
            record = AttestationRecord(
                self.peer_id,
                attestation.run_id,
                attestation.fragment,
                attestation.version,
                attestation.digest,
                sealed,
                wall,
                wall + self.ttl_s,
            )
            try:
                await self.board.announce_attestation(record)
            except AtollError as e:
                logger.info(
                    "publishing the attestation of fragment %d version %d failed: %s",
                    attestation.fragment,
                    attestation.version,
                    e,
                )
                continue
            self.published += 1
            current = self._latest.get(p)
            if current is not None and current[0] == attestation:
                self._latest[p] = (attestation, sealed, trio.current_time())

    def _still_held(self, attestation: Attestation) -> bool:
        if self.held is None:
            return True
        return self.held(attestation.fragment) == (attestation.version, attestation.digest)

    async def run(self) -> None:
        """Publish what :meth:`submit` hands over, retry failures every ``retry_s`` and
        republish before expiry, forever."""
        while True:
            self._wake = trio.Event()  # before publishing: a submit meanwhile wakes the wait
            await self.publish_due()
            with trio.move_on_after(self.retry_s):
                await self._wake.wait()


EVIDENCE_TTL_S = 300.0
"""lifetime of a published evidence record; republished at a third of it"""


class EvidenceBoard(Protocol):
    """Where evidence is published and read (the DHT, or a test's board)."""

    async def announce_evidence(self, record: EvidenceRecord, /) -> None: ...

    async def find_evidence(self) -> list[EvidenceRecord]: ...


class EvidenceExchange:
    """Publishes this node's evidence of forged claims and judges the others' (see the
    module docstring).

    ``sealed_of(peer)`` fetches the sealed value of ``peer``'s record (None when not
    found); ``held(p)`` is this node's (version, digest) of fragment ``p``;
    ``attestations`` is where certificates are looked up (None: no lookups, a claim
    not believed now is judged forged). Times: ``wall`` stamps records; periods run on
    trio's clock.
    """

    def __init__(
        self,
        board: EvidenceBoard,
        *,
        peer_id: str,
        run_id: str,
        wall: Callable[[], float],
        verifier: RecordVerifier,
        strikes: Strikes,
        beliefs: CertifiedStates,
        held: Callable[[int], tuple[int, str]],
        sealed_of: Callable[[str], Awaitable[bytes | None]],
        attestations: AttestationBoard | None = None,
        every_s: float = 5.0,
        ttl_s: float = EVIDENCE_TTL_S,
    ) -> None:
        self.board = board
        self.peer_id = peer_id
        self.run_id = run_id
        self.wall = wall
        self.verifier = verifier
        self.strikes = strikes
        self.beliefs = beliefs
        self.held = held
        self.sealed_of = sealed_of
        self.attestations = attestations
        self.every_s = every_s
        self.ttl_s = ttl_s
        self._accused: list[str] = []  # offenders whose claim is still to be fetched
        self._claims: list[tuple[str, bytes]] = []  # (offender, sealed record), newest first
        self._published_at = -float("inf")
        self._judged: set[bytes] = set()  # claims already judged (bounded)
        self._wake = trio.Event()
        self.published = 0
        self.convicted = 0
        """offenders struck on the evidence of others"""

    # -- this node's evidence --------------------------------------------------------------
    def on_ban(self, ban: Ban) -> None:
        """The strike ledger's ban hook: a ban for a forged claim becomes evidence."""
        if ban.reason.startswith("forged") and ban.peer not in self._accused:
            self._accused.append(ban.peer)
            self._wake.set()

    def forged(self, record: PeerRecord) -> tuple[int, int, str] | None:
        """The first ``(fragment, version, digest)`` ``record`` declares more than one
        version past everything this node believes of that fragment (and does not
        believe), or None."""
        for p, (version, digest) in enumerate(zip(record.versions, record.digests, strict=False)):
            try:
                mine = self.held(p)
            except (IndexError, AtollError):
                continue
            reach = max(self.beliefs.top(p), mine[0]) + 1
            if version > reach and not self.beliefs.believes(p, version, digest):
                return p, version, digest
        return None

    async def publish_due(self) -> None:
        """Fetch the claims of newly banned forgers, then publish the evidence when it
        changed or a third of its lifetime passed."""
        changed = False
        while self._accused:
            offender = self._accused.pop(0)
            try:
                sealed = await self.sealed_of(offender)
            except AtollError as e:
                logger.info("the record of peer %s could not be fetched: %s", offender, e)
                sealed = None
            if sealed is None or len(sealed) > MAX_CLAIM_BYTES:
                continue
            try:
                if (
                    self.forged(open_claim(sealed, run_id=self.run_id, verifier=self.verifier))
                    is None
                ):
                    continue  # its record changed since: nothing to show
            except RejectedRecord:
                continue
            self._claims = [(offender, sealed), *[c for c in self._claims if c[0] != offender]]
            self._claims = self._claims[:MAX_CLAIMS]
            changed = True
        if not self._claims:
            return
        if not changed and trio.current_time() - self._published_at < self.ttl_s / 3:
            return
        wall = self.wall()
        record = EvidenceRecord(
            self.peer_id, self.run_id, tuple(c for _, c in self._claims), wall, wall + self.ttl_s
        )
        try:
            await self.board.announce_evidence(record)
        except AtollError as e:
            logger.info("publishing evidence failed: %s", e)
            return
        self._published_at = trio.current_time()
        self.published += 1
        logger.info(
            "published evidence against %s", ", ".join(offender for offender, _ in self._claims)
        )

    # -- the others' evidence ----------------------------------------------------------------
    async def read(self) -> int:
        """Judge every claim of the others' evidence not judged yet; returns how many
        offenders it struck."""
        try:
            records = await self.board.find_evidence()
        except AtollError as e:
            logger.debug("find_evidence: %s", e)
            return 0
        struck = 0
        for record in records:
            if record.peer_id == self.peer_id or record.run_id != self.run_id:
                continue
            for claim in record.claims:
                if await self.judge(record.peer_id, claim):
                    struck += 1
        return struck

    async def judge(self, accuser: str, claim: bytes) -> bool:
        """Strike the claim's signer when it is a forgery this node can check (see the
        module docstring); True when it struck."""
        if claim in self._judged:
            return False
        if len(self._judged) > 1024:
            self._judged.clear()
        try:
            record = open_claim(claim, run_id=self.run_id, verifier=self.verifier)
        except RejectedRecord as e:
            logger.info("peer %s published a claim that does not hold: %s", accuser, e)
            self._judged.add(claim)
            return False
        offender = record.peer_id
        if offender == self.peer_id or self.strikes.banned(offender):
            return False  # judged again once the ban ends
        found = self.forged(record)
        if found is None:  # beliefs only grow: it never becomes a forgery later
            self._judged.add(claim)
            return False
        p, version, digest = found
        if self.attestations is not None:
            try:
                records = await self.attestations.find_attestations(p, version)
            except AtollError:
                records = []
            seals = [r.attestation for r in records if (r.version, r.digest) == (version, digest)]
            if self.beliefs.offer(p, version, digest, seals, now=trio.current_time()) is not None:
                self._judged.add(claim)
                return False  # certified after all: not a forgery
        self.strikes.strike(
            offender,
            "evidence",
            f"its signed record declares fragment {p} version {version} without a certificate"
            f" (shown by {accuser})",
        )
        self.convicted += 1
        return True

    async def run(self) -> None:
        """Publish this node's evidence as it comes and read the others' every
        ``every_s``, forever."""
        while True:
            self._wake = trio.Event()
            await self.publish_due()
            await self.read()
            with trio.move_on_after(self.every_s):
                await self._wake.wait()
