"""Certified global states: which declared fragment states a peer may believe.

A peer declares, in its DHT record, the version and digest of every fragment's global
copy it holds, and the rule of :mod:`atoll.protocol.statesync` follows the highest
version. Taken on a peer's word, one identity claiming version 10^6 would stall the swarm
(every peer tries to copy that state) or, serving bytes that match its digest, take it
over. So a state is believed only with a *certificate*: the members of the round that
made it each sign what they committed, and a quorum of such signatures vouches for it.

Pieces (sans-IO: bytes and time go in, decisions come out; the signature scheme is
injected, :mod:`atoll.security` provides it and the node wires it):

- :class:`Attestation`: what one member of a committed round signs: run, fragment, the
  version the round made, its digest, the *parent* digest (the state the round started
  from) and the sorted member list. Sealed for :data:`ATTESTATION_DOMAIN` by an
  :class:`AttestationSigner` (:func:`seal_attestation`), opened by an
  :class:`AttestationVerifier` (:func:`open_attestation`).
- :class:`Certificate`: at least ``quorum`` sealed attestations of identical content from
  distinct signers, each listed among the members; :func:`check_certificate` checks one,
  :func:`assemble` finds one in a pile of attestations (what a DHT lookup returns).
- :class:`CertifiedStates`: one node's beliefs. Version 0 is the manifest's seed state
  (its digest every peer computes) and needs no certificate; any other ``(fragment,
  version, digest)`` is believed once a certificate for it was checked (each signature
  is verified once and remembered). :meth:`CertifiedStates.believed` filters the
  ``(peer, version, digest)`` holdings the rule reads, logs an ignored declaration once
  per peer and fragment, and reports its declarer (``on_uncertified``) once the claim
  had time to be certified (``grace_s``), however far ahead it is: after a split heals,
  the other side may be several versions ahead with certificates this node has not
  found yet, and an honest peer must not be reported for that. Nor is a claim that at
  least ``quorum`` peers share (they could sign its certificate anyway). A claim more
  than ``max_lead`` versions past everything believed (more outer steps than a whole run
  has) is no split's work: it is reported at once.
- :class:`AttestationRequest` / :class:`AttestationReply` (kinds 41 and 42): a node asks
  a peer that declares a state for the seals it holds of it (its own attestation, and
  those of a certificate it checked), besides looking them up in the DHT. A reply is
  bounded (:data:`MAX_REPLY_SEALS` seals of at most :data:`MAX_SEALED_BYTES` each) and is
  only evidence: every seal is checked like one from the DHT.

Why the head certificate stands for the whole chain back to the seed: an honest member
signs only a round it committed itself, and it starts every round from a state it
believes (the seed, its own earlier commit, or a state whose certificate it checked when
it rebased). So a certificate with one honest signer among its quorum vouches, through
that signer, for every state before it; a joiner checks the certificate of the state it
copies and the bytes' digest (:class:`~atoll.protocol.statesync.StateAssembler`), and
trusts neither the peer that serves the bytes nor the one that declared the state. What
a quorum of colluding identities can still do is in docs/DESIGN.md ("Certified global
state").
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from atoll.protocol.errors import CodecError, ConfigError, RejectedInput
from atoll.protocol.messages import decode_message, encode_message, wire_message

__all__ = [
    "ATTESTATION_DOMAIN",
    "MAX_ATTESTATION_BYTES",
    "MAX_MEMBERS",
    "MAX_REPLY_SEALS",
    "MAX_SEALED_BYTES",
    "Attestation",
    "AttestationReply",
    "AttestationRequest",
    "AttestationSigner",
    "AttestationVerifier",
    "BadCertificate",
    "Certificate",
    "CertifiedStates",
    "assemble",
    "check_certificate",
    "open_attestation",
    "seal_attestation",
]

log = logging.getLogger(__name__)

ATTESTATION_DOMAIN: str = "atoll/state-attestation/v1"
"""Signature domain of attestations: a seal made for a DHT record or anything else never
opens as one."""

MAX_MEMBERS: int = 32
"""Most members an attestation lists (a group of more signs none; groups are 8 by
default). Bounds an attestation to about 2 KiB and a certificate check to 32 signatures."""

MAX_ATTESTATION_BYTES: int = 2560
"""Most bytes of an attestation's encoding (the payload that gets sealed)."""

MAX_SEALED_BYTES: int = MAX_ATTESTATION_BYTES + 512
"""Most bytes of a sealed attestation (the payload and its envelope)."""

MAX_REPLY_SEALS: int = 8
"""Most sealed attestations in one :class:`AttestationReply`: the replier's own and a few
it has checked (a reply stays within about 24 KiB)."""

_HEX = re.compile("[0-9a-f]{1,128}")
_ID = {"max_len": 128}
_DIGEST = {"max_len": 128}


class BadCertificate(RejectedInput):
    """An attestation or certificate that must not be believed; the message says why.

    Hostile or broken input (a forged or foreign signature, a signer outside the members,
    too few signers, a field that does not match the state it should vouch for).
    """


@wire_message(40)
@dataclass(frozen=True, slots=True)
class Attestation:
    """One member's word that its round of ``fragment`` committed ``version`` with
    ``digest``, starting from ``parent``, in a group of ``members`` (sorted)."""

    run_id: str = field(metadata=_ID)
    fragment: int
    version: int
    """the version the round made (the parent's plus one)"""
    digest: str = field(metadata=_DIGEST)
    """digest of the state at ``version`` (a :class:`~atoll.protocol.statesync.FragmentState`)"""
    parent: str = field(metadata=_DIGEST)
    """digest of the state at ``version - 1`` the round started from"""
    members: tuple[str, ...] = field(metadata={"max_len": MAX_MEMBERS, "item_max_len": 128})
    """the group's members, sorted"""

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise CodecError(f"attestation: {problem}")

    def problem(self) -> str | None:
        """Why this attestation is malformed, or None."""
        if not 0 <= self.fragment <= 0xFFFF:
            return f"fragment {self.fragment} out of range"
        if self.version < 1:
            return f"version {self.version}: version 0 is the seed and needs none"
        for name in ("digest", "parent"):
            if _HEX.fullmatch(getattr(self, name)) is None:
                return f"{name} is not lowercase hex"
        if len(self.members) > MAX_MEMBERS:
            return f"{len(self.members)} members, more than {MAX_MEMBERS}"
        if not self.members or list(self.members) != sorted(set(self.members)):
            return "members are not a sorted list of distinct peers"
        return None

    def payload(self) -> bytes:
        """The bytes that get signed (the wire encoding)."""
        return encode_message(self)


@wire_message(41)
@dataclass(frozen=True, slots=True)
class AttestationRequest:
    """``sender`` asks the receiver for the sealed attestations it holds of ``fragment``
    at ``version`` with ``digest`` (run ``run_id``)."""

    run_id: str = field(metadata=_ID)
    fragment: int
    version: int
    digest: str = field(metadata=_DIGEST)
    sender: str = field(metadata=_ID)


@wire_message(42)
@dataclass(frozen=True, slots=True)
class AttestationReply:
    """The answer to an :class:`AttestationRequest`: the sealed attestations ``sender``
    holds of that state (none when it holds none). Unchecked evidence: the asker opens
    and checks every seal (:meth:`CertifiedStates.offer`)."""

    run_id: str = field(metadata=_ID)
    fragment: int
    version: int
    digest: str = field(metadata=_DIGEST)
    sender: str = field(metadata=_ID)
    seals: tuple[bytes, ...] = field(
        metadata={"max_len": MAX_REPLY_SEALS, "item_max_len": MAX_SEALED_BYTES}
    )


class AttestationSigner(Protocol):
    """Seals bytes with the local peer's identity (atoll.security's envelopes)."""

    def seal(self, domain: str, payload: bytes) -> bytes: ...


class AttestationVerifier(Protocol):
    """Opens sealed bytes and names their signer (atoll.security's envelopes).

    Must refuse, with a :class:`~atoll.protocol.errors.RejectedInput`, a seal that does
    not verify, one for another ``domain`` and a payload over ``max_payload`` bytes.
    """

    def open(self, data: bytes, *, domain: str, max_payload: int) -> tuple[bytes, str]: ...


def seal_attestation(attestation: Attestation, signer: AttestationSigner) -> bytes:
    """``attestation`` sealed by ``signer`` for :data:`ATTESTATION_DOMAIN`."""
    payload = attestation.payload()
    if len(payload) > MAX_ATTESTATION_BYTES:
        raise ConfigError(f"attestation of {len(payload)} bytes is over {MAX_ATTESTATION_BYTES}")
    return signer.seal(ATTESTATION_DOMAIN, payload)


def open_attestation(sealed: bytes, verifier: AttestationVerifier) -> tuple[Attestation, str]:
    """The attestation in ``sealed`` and the peer that signed it; BadCertificate when the
    seal does not open or the payload is no well-formed attestation."""
    if not isinstance(sealed, bytes) or len(sealed) > MAX_SEALED_BYTES:
        raise BadCertificate("a sealed attestation is bytes of bounded size")
    try:
        payload, signer = verifier.open(
            sealed, domain=ATTESTATION_DOMAIN, max_payload=MAX_ATTESTATION_BYTES
        )
        attestation = decode_message(payload, max_bytes=MAX_ATTESTATION_BYTES)
    except RejectedInput as e:  # CodecError, BadSignature
        raise BadCertificate(f"attestation does not open: {e}") from None
    if not isinstance(attestation, Attestation):
        raise BadCertificate(f"a sealed {type(attestation).__name__} is not an attestation")
    return attestation, signer


@dataclass(frozen=True, slots=True)
class Certificate:
    """A checked certificate: the attestation its signers agree on, who signed, and the
    seals (to hand on to a peer that checks it again)."""

    attestation: Attestation
    signers: tuple[str, ...]
    seals: tuple[bytes, ...]


Opener = Callable[[bytes], tuple[Attestation, str]]
"""``open(sealed) -> (attestation, signer)``, raising BadCertificate: a verifier, cached
or not."""


def _check(
    opened: Sequence[tuple[bytes, Attestation, str]],
    *,
    run_id: str,
    fragment: int,
    version: int,
    digest: str,
    quorum: int,
    admit: Callable[[str], bool] | None,
) -> Certificate:
    if quorum < 1:
        raise ConfigError(f"a certificate quorum is >= 1, not {quorum}")
    if not opened:
        raise BadCertificate("no attestations")
    first = opened[0][1]
    if (first.run_id, first.fragment, first.version, first.digest) != (
        run_id,
        fragment,
        version,
        digest,
    ):
        raise BadCertificate(
            f"attests fragment {first.fragment} version {first.version} {first.digest[:12]}"
            f" of run {first.run_id[:12]}, not fragment {fragment} version {version}"
            f" {digest[:12]} of run {run_id[:12]}"
        )
    signers: list[str] = []
    for _, attestation, signer in opened:
        if attestation != first:
            raise BadCertificate(f"{signer} attests other content than {opened[0][2]}")
        if signer in signers:
            raise BadCertificate(f"{signer} signed twice")
        if signer not in first.members:
            raise BadCertificate(f"{signer} signed but is not a member")
        if admit is not None and not admit(signer):
            raise BadCertificate(f"{signer} is not admitted to the run")
        signers.append(signer)
    if len(signers) < quorum:
        raise BadCertificate(f"{len(signers)} distinct signers, fewer than the quorum of {quorum}")
    return Certificate(first, tuple(signers), tuple(s for s, _, _ in opened))


def check_certificate(
    seals: Sequence[bytes],
    *,
    run_id: str,
    fragment: int,
    version: int,
    digest: str,
    quorum: int,
    verifier: AttestationVerifier | Opener,
    admit: Callable[[str], bool] | None = None,
) -> Certificate:
    """The certificate that ``seals`` make for ``(fragment, version, digest)`` of run
    ``run_id``, or BadCertificate.

    Every seal must open (signature valid for :data:`ATTESTATION_DOMAIN`), all must attest
    identical content naming this run, fragment, version and digest, the signers must be
    distinct, listed among the members and, with ``admit``, admitted to the run (a private
    swarm's membership), and there must be at least ``quorum`` of them. At most
    :data:`MAX_MEMBERS` seals are looked at (more cannot all be distinct members).
    """
    if len(seals) > MAX_MEMBERS:
        raise BadCertificate(f"{len(seals)} attestations, more than {MAX_MEMBERS} members")
    opener = _opener(verifier)
    opened = [(s, *opener(s)) for s in seals]
    return _check(
        opened,
        run_id=run_id,
        fragment=fragment,
        version=version,
        digest=digest,
        quorum=quorum,
        admit=admit,
    )


def assemble(
    seals: Iterable[bytes],
    *,
    run_id: str,
    fragment: int,
    version: int,
    digest: str,
    quorum: int,
    verifier: AttestationVerifier | Opener,
    admit: Callable[[str], bool] | None = None,
) -> Certificate | None:
    """A certificate for ``(fragment, version, digest)`` found among ``seals`` (any
    mixture: other digests, bad seals, forged ones), or None.

    Attestations that do not open, or attest anything else, are left out; the rest are
    grouped by content (the member list and parent may differ between two groups of one
    slot) and the first group that makes a certificate is returned. Each signer counts
    once per group.
    """
    opener = _opener(verifier)
    groups: dict[Attestation, dict[str, bytes]] = {}
    for s in seals:
        try:
            attestation, signer = opener(s)
        except BadCertificate:
            continue
        if (
            attestation.run_id,
            attestation.fragment,
            attestation.version,
            attestation.digest,
        ) != (run_id, fragment, version, digest):
            continue
        groups.setdefault(attestation, {}).setdefault(signer, s)
    for attestation, by_signer in groups.items():
        opened = [
            (s, attestation, signer)
            for signer, s in list(by_signer.items())[:MAX_MEMBERS]
            if signer in attestation.members
        ]
        try:
            return _check(
                opened,
                run_id=run_id,
                fragment=fragment,
                version=version,
                digest=digest,
                quorum=quorum,
                admit=admit,
            )
        except BadCertificate:
            continue
    return None


def _opener(verifier: AttestationVerifier | Opener) -> Opener:
    if callable(verifier) and not hasattr(verifier, "open"):
        return verifier

    def opener(sealed: bytes) -> tuple[Attestation, str]:
        return open_attestation(sealed, verifier)

    return opener


# --------------------------------------------------------------------------------------
# one node's beliefs
# --------------------------------------------------------------------------------------
State = tuple[int, int, str]  # (fragment, version, digest)
Holding = tuple[str, int, str]  # (peer, version, digest)
OnUncertified = Callable[[str, int, int], None]
"""``(peer, fragment, version)``: a peer declared a state no certificate vouches for."""


class CertifiedStates:
    """Which fragment states one node believes (see the module docstring).

    ``seeds[p]`` is the digest of fragment ``p``'s seed state (version 0), or "" when
    unknown (then no version 0 other than this node's own is believed). ``quorum`` is the
    manifest's ``group.min_quorum``. ``grace_s`` is how long a declared state may wait for
    its certificate (its members publish their attestations after the commit) before its
    declarer is reported; ``max_lead`` (None: no bound) how many versions past everything
    believed a claim may be and still wait out its grace (a run of ``total_steps`` inner
    steps syncs each fragment ``total_steps / H`` times, so a claim further ahead than
    that is impossible for any honest peer and is reported at once); ``retry_s`` how long
    a failed lookup is not repeated.
    Times are the caller's monotonic clock.
    """

    def __init__(
        self,
        run_id: str,
        *,
        quorum: int,
        verifier: AttestationVerifier,
        seeds: Sequence[str],
        admit: Callable[[str], bool] | None = None,
        on_uncertified: OnUncertified | None = None,
        grace_s: float = 30.0,
        max_lead: int | None = None,
        retry_s: float = 5.0,
        max_cached: int = 4096,
    ) -> None:
        if quorum < 1:
            raise ConfigError(f"a certificate quorum is >= 1, not {quorum}")
        self.run_id = run_id
        self.quorum = quorum
        self.verifier = verifier
        self.seeds = list(seeds)
        self.admit = admit
        self.on_uncertified = on_uncertified
        if max_lead is not None and max_lead < 1:
            raise ConfigError(f"max_lead is >= 1 versions, not {max_lead}")
        self.grace_s = grace_s
        self.max_lead = max_lead
        self.retry_s = retry_s
        self.max_cached = max_cached
        self._certs: OrderedDict[State, Certificate] = OrderedDict()
        self._opened: OrderedDict[bytes, tuple[Attestation, str] | None] = OrderedDict()
        self._tried: dict[State, float] = {}  # last failed lookup
        self._first_seen: dict[tuple[str, State], float] = {}
        self._reported: set[tuple[str, State]] = set()
        self._logged: set[tuple[str, int]] = set()
        self._top: dict[int, int] = {}  # highest believed version per fragment
        self.verified = 0
        """signatures verified so far (each seal once)"""

    # -- queries -------------------------------------------------------------------------
    def believes(self, fragment: int, version: int, digest: str) -> bool:
        """Whether ``(fragment, version, digest)`` is the seed or certified."""
        if version == 0:
            return 0 <= fragment < len(self.seeds) and digest == self.seeds[fragment] != ""
        return (fragment, version, digest) in self._certs

    def certificate(self, fragment: int, version: int, digest: str) -> Certificate | None:
        """The checked certificate of that state, if one is held."""
        return self._certs.get((fragment, version, digest))

    def seals(self, fragment: int, version: int, digest: str) -> tuple[bytes, ...]:
        """The seals of the checked certificate of that state (none when none is held):
        what this node can hand to a peer that asks."""
        cert = self._certs.get((fragment, version, digest))
        return () if cert is None else cert.seals

    def top(self, fragment: int) -> int:
        """The highest version of ``fragment`` believed so far (0 when none)."""
        return self._top.get(fragment, 0)

    def reported(self, peer: str) -> bool:
        """Whether ``peer`` was reported for an uncertified declaration."""
        return any(p == peer for p, _ in self._reported)

    # -- the rule's input ----------------------------------------------------------------
    def believed(
        self,
        fragment: int,
        holdings: Iterable[Holding],
        *,
        now: float,
        mine: tuple[int, str] | None = None,
    ) -> list[Holding]:
        """The ``holdings`` of ``fragment`` whose state is believed; the rest are
        ignored (logged once per peer and fragment) and their declarers reported once
        their claim is past its grace, unless at least ``quorum`` peers declare that same
        state: that many could sign its certificate anyway, so reporting them proves
        nothing, while an honest swarm whose certificates this node cannot find yet (a
        node back from a cut on a loaded machine: 22 s of failed lookups) would be banned
        whole. A claim past ``max_lead`` is reported at once, shared or not. ``mine``,
        this node's own state, is always believed by itself (it committed or checked
        it)."""
        rows = list(holdings)
        declarers: dict[tuple[int, str], set[str]] = {}
        for peer, version, digest in rows:
            declarers.setdefault((version, digest), set()).add(peer)
        out: list[Holding] = []
        for peer, version, digest in rows:
            if (version, digest) == mine or self.believes(fragment, version, digest):
                out.append((peer, version, digest))
                continue
            shared = len(declarers[(version, digest)]) >= self.quorum
            self._ignore(peer, fragment, version, digest, now, mine, shared=shared)
        return out

    def to_check(
        self,
        fragment: int,
        holdings: Iterable[Holding],
        *,
        now: float,
        mine: tuple[int, str],
        limit: int = 4,
    ) -> list[tuple[int, str]]:
        """The states of ``holdings`` worth a certificate lookup now: not believed, not
        this node's, not behind it, not looked up in vain within ``retry_s``; the most
        held first, then the highest; at most ``limit`` (a crowd of liars with a claim
        each costs a few lookups per sync, not one each)."""
        held: dict[tuple[int, str], set[str]] = {}
        for peer, version, digest in holdings:
            state = (version, digest)
            if state == mine or version < mine[0] or self.believes(fragment, *state):
                continue
            tried = self._tried.get((fragment, version, digest))
            if tried is not None and now - tried < self.retry_s:
                continue
            held.setdefault(state, set()).add(peer)
        order = sorted(held, key=lambda s: (-len(held[s]), -s[0], s[1]))
        return order[:limit]

    # -- evidence ------------------------------------------------------------------------
    def offer(
        self, fragment: int, version: int, digest: str, seals: Iterable[bytes], *, now: float
    ) -> Certificate | None:
        """Look for a certificate of ``(fragment, version, digest)`` among ``seals`` (a
        lookup's attestations); remember it when found, else the failed try."""
        state = (fragment, version, digest)
        held = self._certs.get(state)
        if held is not None or version == 0:
            return held
        cert = assemble(
            seals,
            run_id=self.run_id,
            fragment=fragment,
            version=version,
            digest=digest,
            quorum=self.quorum,
            verifier=self._open,
            admit=self.admit,
        )
        if cert is None:
            self._tried[state] = now
            return None
        self._tried.pop(state, None)
        self._certs[state] = cert
        while len(self._certs) > self.max_cached:
            self._certs.popitem(last=False)
        self._top[fragment] = max(self._top.get(fragment, 0), version)
        log.info(
            "fragment %d version %d (%s) certified by %d of %d members",
            fragment,
            version,
            digest[:12],
            len(cert.signers),
            len(cert.attestation.members),
        )
        return cert

    def _open(self, sealed: bytes) -> tuple[Attestation, str]:
        """open_attestation, each seal verified once (a failure is remembered too)."""
        key = hashlib.sha256(sealed).digest() if isinstance(sealed, bytes) else b""
        if key in self._opened:
            self._opened.move_to_end(key)
            hit = self._opened[key]
            if hit is None:
                raise BadCertificate("an attestation already refused")
            return hit
        try:
            opened: tuple[Attestation, str] | None = open_attestation(sealed, self.verifier)
        except BadCertificate:
            opened = None
        self.verified += 1
        self._opened[key] = opened
        while len(self._opened) > self.max_cached:
            self._opened.popitem(last=False)
        if opened is None:
            raise BadCertificate("attestation does not open")
        return opened

    def _ignore(
        self,
        peer: str,
        fragment: int,
        version: int,
        digest: str,
        now: float,
        mine: tuple[int, str] | None,
        *,
        shared: bool = False,
    ) -> None:
        key = (peer, (fragment, version, digest))
        first = self._first_seen.setdefault(key, now)
        if len(self._first_seen) > self.max_cached:  # forget the oldest claims
            for old in list(self._first_seen)[: len(self._first_seen) // 2]:
                del self._first_seen[old]
        if (peer, fragment) not in self._logged:
            self._logged.add((peer, fragment))
            log.info(
                "ignoring peer %s's fragment %d version %d (%s): no certificate",
                peer,
                fragment,
                version,
                digest[:12],
            )
        if key in self._reported:
            return
        reach = max(self.top(fragment), mine[0] if mine is not None else 0) + 1
        impossible = self.max_lead is not None and version > reach + self.max_lead
        if (now - first >= self.grace_s and not shared) or impossible:
            self._reported.add(key)
            log.warning(
                "peer %s declares fragment %d version %d (%s) without a certificate%s",
                peer,
                fragment,
                version,
                digest[:12],
                f" (the swarm is at version {reach - 1})" if version > reach else "",
            )
            if self.on_uncertified is not None:
                self.on_uncertified(peer, fragment, version)
