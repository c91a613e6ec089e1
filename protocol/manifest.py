"""The run manifest: the one document that defines a training run for every peer.

A swarm trains one model under one set of rules. Everything the peers must agree on (model
preset, data, schedule, codec, outer optimizer, group sizes, timeouts) lives in a small
TOML file, the *manifest*; its :meth:`RunManifest.run_id` is a sha256 over a canonical
encoding of it and identifies the run on the wire and in the DHT. Two peers whose run ids
differ never average together, so a peer with another learning rate, H or codec cannot
poison a run by accident::

    name = "tiny-stdlib"
    H = 100
    codec = "e3m0"

    [group]
    min_quorum = 2
    max_size = 8

    [timeouts]
    round_s = 120.0

Keys left out take their defaults; unknown keys are refused with the closest known name,
so a typo never silently falls back to a default. A value of the wrong type, or out of
range, raises :class:`~atoll.protocol.errors.ConfigError` naming the key and the file.

Equal manifests have equal run ids: values are normalised first (an integer given for a
float becomes that float, ``-0.0`` becomes ``0.0``, codec names and the corpus hash are
lowercased), so that two spellings of the same run cannot split a swarm in two.

A manifest may name its owner (``owner = "12D3KooW..."``, the peer id of the owner's key);
a joiner then requires the owner's signature over the run id next to the manifest
(:mod:`atoll.security.manifest_sig`, ``atoll manifest sign``). Like the ``[membership]``
and ``[robust]`` tables, an empty owner is left out of the run id and the TOML, and so is
``batching`` while it is ``"windows"``.

The outer-loop settings (H, τ, α, codec, outer optimizer, aggregation) are declared once,
in :class:`OuterLoop`: the manifest is one (its keys are the manifest's top-level keys),
the engine takes one, and the simulator and the demo build one from their own choices.

This module is pure: :meth:`RunManifest.from_toml` takes text, and only the convenience
:meth:`RunManifest.load` reads a file.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import math
import os
import tomllib
import typing
from collections.abc import Iterable
from dataclasses import Field, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import msgpack

from atoll.protocol.checks import PartChecks
from atoll.protocol.codecs import Codec, make_codec
from atoll.protocol.errors import ConfigError
from atoll.protocol.fragments import EXTRAS_RULES
from atoll.protocol.robust import RobustRule

__all__ = [
    "AGGREGATIONS",
    "BATCHINGS",
    "MANIFEST_VERSION",
    "MEMBERSHIP_MODES",
    "GroupSettings",
    "MembershipSettings",
    "OuterLoop",
    "RunManifest",
    "Timeouts",
    "short_id",
]

AGGREGATIONS = ("mean", "rda")
"""How a group combines its pseudo-gradients: token-weighted mean, or radial-directional."""

MEMBERSHIP_MODES = ("public", "private")
"""Who may take part: anyone, or the members the ``[membership]`` table names."""

BATCHINGS = ("windows", "documents")
"""What a batch is: random windows of the model's sequence length, or whole documents of
variable length (``atoll.node.documents``)."""

MANIFEST_VERSION: int = 1
"""Version of the canonical encoding hashed into the run id; bump it when fields change
meaning, so that peers of different atoll releases cannot share a run by accident."""

_NAME_MAX = 100
_STR_MAX = 1000
_INT_BOUND = 1 << 63  # every integer must fit a msgpack int64
_HEX = frozenset("0123456789abcdef")


# -- shared checks -------------------------------------------------------------------------
def _describe(value: object) -> str:
    """``value`` with its TOML-ish type, short enough for an error message."""
    if isinstance(value, bool):
        kind = "a boolean"
    elif isinstance(value, int):
        kind = "an integer"
    elif isinstance(value, float):
        kind = "a float"
    elif isinstance(value, str):
        kind = "a string"
    elif isinstance(value, list | tuple):
        kind = "an array"
    elif isinstance(value, dict):
        kind = "a table"
    else:
        kind = f"a {type(value).__name__}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


def _scalar(key: str, value: object, kind: object) -> object:
    """Check ``value`` against the field type ``kind`` and return its normal form."""
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, not {_describe(value)}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, not {_describe(value)}")
        if not -_INT_BOUND <= value < _INT_BOUND:
            raise ConfigError(f"{key} is out of the 64-bit integer range: {value}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, not {_describe(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(f"{key} is too large: {value}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key} must be a finite number, not {number}")
        return number + 0.0  # -0.0 + 0.0 == +0.0: one encoding for one value
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, not {_describe(value)}")
        if len(value) > _STR_MAX:
            raise ConfigError(f"{key} is longer than {_STR_MAX} characters")
        if not value.isprintable():
            # no control characters or lone surrogates: the value goes into logs and
            # into a UTF-8 encoding that is hashed
            raise ConfigError(f"{key} holds a non-printable character: {value!r}")
        return value
    raise AssertionError(f"unsupported manifest field type {kind!r}")  # pragma: no cover


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _normalise(obj: Any, prefix: str, only: Iterable[Field[Any]] | None = None) -> None:
    """Type-check every scalar field of the dataclass ``obj`` (or those of ``only``) and
    store its normal form."""
    hints = _hints(obj.__class__)
    for f in fields(obj) if only is None else only:
        kind = hints[f.name]
        value = getattr(obj, f.name)
        if isinstance(kind, type) and is_dataclass(kind):
            if not isinstance(value, kind):
                raise ConfigError(
                    f"{prefix}{f.name} must be a {kind.__name__} (the [{f.name}] table), "
                    f"not {_describe(value)}"
                )
            continue
        object.__setattr__(obj, f.name, _scalar(prefix + f.name, value, kind))


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, not {value}")


# -- the settings ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OuterLoop:
    """The outer loop of Streaming DiLoCo (arXiv 2501.18512): every setting, declared once.

    Its fields are the manifest's outer-loop keys, with their defaults and their help, and
    :meth:`__post_init__` holds all of their checks; an ``OuterLoop`` that exists is valid.
    It lives here, next to the manifest, because the manifest is one: :class:`RunManifest`
    inherits it, so its fields stay top-level keys of the TOML (``H = 100``, ``codec =
    "e3m0"``) and its checks run once, with the manifest's type checks and messages. The
    engine takes one (:data:`atoll.protocol.engine.EngineConfig` is this class), the outer
    optimizer reads its ``outer_*`` and ``nesterov`` fields, and the simulator and the demo
    build one from what they choose. The codec spec (``codec`` with ``codec_block``) is
    validated only here, by building the codec.

    Values take a normal form: an integer given for a float becomes that float, ``-0.0``
    becomes ``0.0`` and the codec name is lowercased, so that equal settings compare equal.
    """

    H: int = 100
    """inner steps between two syncs of the same fragment"""
    tau: int = 1
    """inner steps a sync may overlap with training (0 = blocking, vanilla DiLoCo)"""
    alpha: float = 0.5
    """merge weight of the local copy: local ← α·local + (1−α)·global"""
    codec: str = "e3m0"
    """wire codec of pseudo-gradients: fp32, bf16, int8, e3m0, e3m0-sr"""
    codec_block: int = 128
    """values per scale for the blockwise codecs"""
    outer_lr: float = 0.7
    """learning rate of the outer SGD"""
    outer_momentum: float = 0.9
    """momentum of the outer SGD"""
    nesterov: bool = True
    """Nesterov momentum (else heavy ball)"""
    error_feedback: bool = False
    """carry what quantization lost into the fragment's next pseudo-gradient"""
    aggregation: str = "mean"
    """mean (token-weighted) or rda (radial-directional, Decoupled DiLoCo)"""

    def __post_init__(self) -> None:
        _normalise(self, "", fields(OuterLoop))
        object.__setattr__(self, "codec", self.codec.strip().lower())
        if self.H < 1:
            raise ConfigError(f"H must be >= 1, not {self.H}")
        if not 0 <= self.tau < self.H:
            raise ConfigError(f"tau must be in [0, H={self.H}), not {self.tau}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], not {self.alpha}")
        if self.codec_block < 1:
            raise ConfigError(f"codec_block must be >= 1, not {self.codec_block}")
        _positive("outer_lr", self.outer_lr)
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"outer_momentum must be in [0, 1), not {self.outer_momentum}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"aggregation must be one of {AGGREGATIONS}, not {self.aggregation!r}"
            )
        try:
            self.make_codec()
        except ConfigError as e:
            raise ConfigError(
                f"codec = {self.codec!r}, codec_block = {self.codec_block}: {e}"
            ) from e

    def make_codec(self) -> Codec:
        """The wire codec these settings name (``codec`` with ``codec_block``)."""
        return make_codec(self.codec, block=self.codec_block)


@dataclass(frozen=True, slots=True)
class GroupSettings:
    """How averaging groups form (the ``[group]`` table).

    A round needs ``min_quorum`` peers; once that many are ready, the group waits
    ``grace_s`` more for late peers, up to ``max_size`` members. ``min_quorum = 1`` is
    allowed and means that a peer alone still completes its round: it applies its own
    pseudo-gradient as the outer step and trains on (useful for the first peer of a run and
    for tests). With the default 2, a peer alone skips the round and its work stays in its
    local copy until the next round it gets a group for.
    """

    min_quorum: int = 2
    """fewest members for a round to happen (1 = a lone peer applies its own round)"""
    max_size: int = 8
    """most members in one averaging group"""
    grace_s: float = 2.0
    """seconds to wait for more peers once the quorum is reached (0 = start at once)"""

    def __post_init__(self) -> None:
        _normalise(self, "group.")
        if self.min_quorum < 1:
            raise ConfigError(f"group.min_quorum must be >= 1, not {self.min_quorum}")
        if self.max_size < 2:
            raise ConfigError(f"group.max_size must be >= 2, not {self.max_size}")
        if self.min_quorum > self.max_size:
            raise ConfigError(
                f"group.min_quorum ({self.min_quorum}) must be <= group.max_size ({self.max_size})"
            )
        if self.grace_s < 0:
            raise ConfigError(f"group.grace_s must be >= 0, not {self.grace_s}")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Every network wait of a round, in seconds (the ``[timeouts]`` table).

    A wait that runs out raises :class:`~atoll.protocol.errors.ExchangeTimeout` or ends the
    round with :class:`~atoll.protocol.errors.RoundAborted`; the fragment then skips that
    round and trains on, so a slow or vanished peer costs time, never a wrong result.
    """

    dial_s: float = 10.0
    """opening a connection to one peer (transport, security handshake and Hello)"""
    matchmaking_s: float = 15.0
    """from declaring ready for a round to knowing the group (quorum plus grace); at most
    twice this while peers are expected at the slot (matchmaking's patience)"""
    part_s: float = 30.0
    """one phase of the all-reduce: all of the reduce-scatter, or all of the all-gather"""
    round_s: float = 120.0
    """a whole round after matchmaking: both phases, the reduction and the checks"""
    apply_wait_s: float = 5.0
    """how long the trainer blocks at a round's apply step before it skips the round"""

    def __post_init__(self) -> None:
        _normalise(self, "timeouts.")
        for f in fields(self):
            _positive(f"timeouts.{f.name}", getattr(self, f.name))
        if self.part_s > self.round_s:
            raise ConfigError(
                f"timeouts.part_s ({self.part_s}) must be <= timeouts.round_s ({self.round_s}):"
                " one phase cannot outlast the round it belongs to"
            )


_MAX_MEMBERS = 10_000
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])  # identity multihash, Ed25519
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _is_ed25519_peer_id(text: str) -> bool:
    """Whether ``text`` is a libp2p Ed25519 peer id (base58btc of the inlined key).

    The same test as :func:`atoll.security.identity.public_key_from_peer_id`, repeated
    here because the protocol package imports nothing of atoll.security.
    """
    if not 40 <= len(text) <= 64 or not set(text) <= set(_B58):
        return False
    n = 0
    for c in text:
        n = n * 58 + _B58.index(c)
    zeros = len(text) - len(text.lstrip("1"))  # each leading "1" is a zero byte
    raw = b"\0" * zeros + n.to_bytes((n.bit_length() + 7) // 8, "big")
    return len(raw) == len(_PEER_ID_PREFIX) + 32 and raw.startswith(_PEER_ID_PREFIX)


def _peer_ids(key: str, value: object) -> tuple[str, ...]:
    """The peer ids of a list setting, checked, deduplicated and sorted."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ConfigError(f"{key} must be an array of peer ids, not {_describe(value)}")
    if len(value) > _MAX_MEMBERS:
        raise ConfigError(f"{key} holds more than {_MAX_MEMBERS} entries")
    for item in value:
        if not isinstance(item, str):
            raise ConfigError(f"{key}: {_describe(item)} is not a string")
    return tuple(sorted(set(value)))


@dataclass(frozen=True, slots=True)
class MembershipSettings:
    """Who may take part in the run (the ``[membership]`` table).

    ``public`` (the default): anyone. ``private``: the peers on ``allowlist`` and the
    holders of a member certificate signed by the organisation key ``org_key`` (``atoll
    org issue``); a private table names at least one of the two. ``revoked`` lists peer
    ids, and certificate ids (64 hex digits, printed by ``atoll org issue``), that may not
    take part whatever else says so. :class:`atoll.security.membership.Membership` applies
    it. Being part of the manifest, it is part of the run id: peers that disagree on who
    is a member never average together. A manifest without the table has the run id it
    had before the table existed.
    """

    mode: str = "public"
    """public (anyone) or private (allowlist and/or organisation certificates)"""
    allowlist: tuple[str, ...] = ()
    """peer ids admitted in a private run"""
    org_key: str = ""
    """the organisation's Ed25519 public key, 64 hex digits (atoll keygen prints it)"""
    revoked: tuple[str, ...] = ()
    """peer ids and certificate ids refused whatever else admits them"""

    def __post_init__(self) -> None:
        mode = _scalar("membership.mode", self.mode, str)
        if mode not in MEMBERSHIP_MODES:
            raise ConfigError(f"membership.mode must be one of {MEMBERSHIP_MODES}, not {mode!r}")
        allow = _peer_ids("membership.allowlist", self.allowlist)
        for peer in allow:
            if not _is_ed25519_peer_id(peer):
                raise ConfigError(
                    f"membership.allowlist: {_describe(peer)} is not an Ed25519 peer id"
                )
        revoked = _peer_ids("membership.revoked", self.revoked)
        for item in revoked:
            is_cert = len(item) == 64 and set(item) <= _HEX
            if not is_cert and not _is_ed25519_peer_id(item):
                raise ConfigError(
                    f"membership.revoked: {_describe(item)} is neither a peer id nor a "
                    "certificate id (64 lowercase hex digits)"
                )
        org_key = _scalar("membership.org_key", self.org_key, str)
        assert isinstance(org_key, str)
        org_key = org_key.strip().lower()
        if org_key and (len(org_key) != 64 or not set(org_key) <= _HEX):
            raise ConfigError(
                f"membership.org_key must be 64 hex digits (an Ed25519 public key), "
                f"not {self.org_key!r}"
            )
        if mode == "private" and not allow and not org_key:
            raise ConfigError("membership.mode = 'private' needs an allowlist, an org_key or both")
        if mode == "public" and (allow or org_key):
            raise ConfigError(
                "membership.allowlist and membership.org_key need membership.mode = 'private'"
            )
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "allowlist", allow)
        object.__setattr__(self, "revoked", revoked)
        object.__setattr__(self, "org_key", org_key)


@dataclass(frozen=True, slots=True)
class RobustSettings:
    """How a chunk's owner checks and combines the members' parts (the ``[robust]`` table;
    docs/ALGORITHMS.md §5.3).

    ``rule``: ``mean`` (the token-weighted mean: a swarm of trusted peers, the default),
    ``trimmed_mean`` or ``centered_clip`` (:class:`atoll.protocol.robust.RobustRule`, with
    ``trim``, ``clip_scale`` and ``iterations``). ``checks``: reject a part whose norm or
    token weight exceeds ``norm_factor`` or ``weight_factor`` times the group's lower
    median (:class:`atoll.protocol.checks.PartChecks`); the round then fails and names
    the sender. ``verify_owners``: each chunk is reduced by its owner and again by a
    verifier, and members commit only the bytes both agree on, so a hostile owner cannot
    make honest members commit a wrong chunk (:class:`atoll.protocol.allreduce.RoundSpec`).
    Part of the run id only when it is not the default, so the run ids of manifests
    written before the table existed stay what they were.
    """

    rule: str = "mean"
    """mean, trimmed_mean or centered_clip"""
    trim: float = 0.25
    """trimmed_mean: the share of the group dropped at each end of every coordinate"""
    clip_scale: float = 2.0
    """centered_clip: the clipping radius in multiples of the median distance"""
    iterations: int = 3
    """centered_clip: iterations from the coordinate-wise median"""
    checks: bool = False
    """check each part's norm and token weight against the group's before reducing"""
    norm_factor: float = 10.0
    """checks: most times the group's lower median norm a part may have"""
    weight_factor: float = 10.0
    """checks: most times the group's lower median token weight a part may claim"""
    verify_owners: bool = False
    """a second member recomputes every chunk before anyone commits it (1.5x the bytes)"""

    def __post_init__(self) -> None:
        _normalise(self, "robust.")
        try:  # the rule and the checks validate their own values
            self.to_rule()
            PartChecks(norm_factor=self.norm_factor, weight_factor=self.weight_factor)
        except ConfigError as e:
            raise ConfigError(f"robust: {e}") from e

    def to_rule(self) -> RobustRule:
        """The owner's combining rule."""
        return RobustRule(
            kind=self.rule,  # type: ignore[arg-type]  # checked by RobustRule
            trim=self.trim,
            clip_scale=self.clip_scale,
            iterations=self.iterations,
        )

    def to_checks(self) -> PartChecks | None:
        """The part checks, or None when ``checks`` is off."""
        if not self.checks:
            return None
        return PartChecks(norm_factor=self.norm_factor, weight_factor=self.weight_factor)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunManifest(OuterLoop):
    """Everything the peers of one run must agree on; :meth:`run_id` names it.

    The outer-loop fields (H, tau, alpha, codec, ...) are inherited from :class:`OuterLoop`,
    which declares and checks them; the fields below are the run's own: the model, the data
    and the inner loop of the trainer, and the ``[group]`` and ``[timeouts]`` tables.
    Construction validates everything; a manifest that exists is a valid one.
    """

    name: str
    """human name of the run (1 to 100 printable characters)"""
    model: str = "tiny"
    """model preset (micro, tiny, small, base, 125m, 350m, 1b) or hf:CONFIG.json"""
    data: str = "stdlib"
    """'stdlib' or comma-separated text/jsonl files or folders"""
    corpus_sha256: str = ""
    """when set, a peer whose corpus fingerprint differs refuses to join"""
    seed: int = 0
    """seed of the initial weights and of the data order"""
    batch_size: int = 16
    """sequences per peer per inner step"""
    batching: str = "windows"
    """windows (batch_size random windows of seq_len bytes) or documents (whole documents
    of up to seq_len bytes, batch_size × seq_len tokens in all, trained as micro-batches)"""
    lr: float = 3e-3
    """peak inner learning rate"""
    warmup: int = 50
    """linear warmup steps of the inner learning rate"""
    total_steps: int = 100_000
    """inner steps of the cosine decay (the run's planned length)"""
    min_lr_ratio: float = 0.1
    """the cosine ends at lr × this"""
    blocks_per_fragment: int = 3
    """transformer blocks per fragment"""
    extras: str = "own"
    """where embeddings, final norm and head go: own, first or last fragment"""
    owner: str = ""
    """peer id of the run owner's key; when set, a joiner requires the manifest's
    signature by that key (``atoll manifest sign``)"""
    group: GroupSettings = field(default_factory=GroupSettings)
    """how averaging groups form"""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """every network wait of a round"""
    membership: MembershipSettings = field(default_factory=MembershipSettings)
    """who may take part (public, or private with an allowlist or organisation key)"""
    robust: RobustSettings = field(default_factory=RobustSettings)
    """how a chunk's owner checks and combines the parts (default: the plain mean)"""

    def __post_init__(self) -> None:
        _normalise(self, "", _own_fields())
        name = self.name
        if not name.strip():
            raise ConfigError("name must not be empty")
        if len(name) > _NAME_MAX:
            raise ConfigError(f"name must be at most {_NAME_MAX} characters, not {len(name)}")
        if name != name.strip():
            raise ConfigError(f"name must not start or end with whitespace: {name!r}")
        for key in ("model", "data"):
            if not getattr(self, key).strip():
                raise ConfigError(f"{key} must not be empty")
        digest = self.corpus_sha256.lower()
        if digest and (len(digest) != 64 or not set(digest) <= _HEX):
            raise ConfigError(
                f"corpus_sha256 must be empty or 64 hex digits, not {self.corpus_sha256!r}"
            )
        object.__setattr__(self, "corpus_sha256", digest)
        if self.owner and not _is_ed25519_peer_id(self.owner):
            raise ConfigError(
                f"owner must be empty or the owner's Ed25519 peer id (12D3KooW..., as "
                f"'atoll keygen' prints it), not {self.owner!r}"
            )
        OuterLoop.__post_init__(self)
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, not {self.seed}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, not {self.batch_size}")
        if self.batching not in BATCHINGS:
            raise ConfigError(f"batching must be one of {BATCHINGS}, not {self.batching!r}")
        _positive("lr", self.lr)
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, not {self.warmup}")
        if self.total_steps < 1:
            raise ConfigError(f"total_steps must be >= 1, not {self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], not {self.min_lr_ratio}")
        if self.blocks_per_fragment < 1:
            raise ConfigError(f"blocks_per_fragment must be >= 1, not {self.blocks_per_fragment}")
        if self.extras not in EXTRAS_RULES:
            raise ConfigError(f"extras must be one of {EXTRAS_RULES}, not {self.extras!r}")
        if self.group.grace_s >= self.timeouts.matchmaking_s:
            raise ConfigError(
                f"group.grace_s ({self.group.grace_s}) must be < timeouts.matchmaking_s "
                f"({self.timeouts.matchmaking_s}): matchmaking would end before the grace does"
            )

    # -- derived -----------------------------------------------------------------------------
    def engine_config(self) -> OuterLoop:
        """The outer-loop settings of this run alone, as the engine takes them."""
        return OuterLoop(**{f.name: getattr(self, f.name) for f in fields(OuterLoop)})

    def run_id(self) -> str:
        """The run's identity: lowercase hex sha256 of the canonical encoding.

        The encoding is msgpack of ``{"manifest_version": MANIFEST_VERSION, "run": {...}}``
        with every table's keys sorted, so it depends on the values alone, not on the order
        or spelling of the TOML they came from. Any change of any field changes it. The
        ``membership`` and ``robust`` tables and the ``owner`` and ``batching`` keys are
        left out while they are the default (public, nothing revoked; the plain mean; no
        owner; windows), so the run ids of manifests written before they existed stay
        what they were.
        """
        run = _canonical(self)
        for key, default in (_OPTIONAL_TABLES | _OPTIONAL_KEYS).items():
            if getattr(self, key) == default:
                del run[key]
        document = {"manifest_version": MANIFEST_VERSION, "run": run}
        packed = msgpack.packb(document, use_bin_type=True)
        return hashlib.sha256(packed).hexdigest()

    # -- TOML ------------------------------------------------------------------------------
    @classmethod
    def from_toml(cls, text: str, *, source: str = "<manifest>") -> RunManifest:
        """Parse and validate a manifest; ``source`` names it in error messages.

        Top-level keys are the scalar fields; ``[group]``, ``[timeouts]`` and
        ``[membership]`` hold :class:`GroupSettings`, :class:`Timeouts` and
        :class:`MembershipSettings`. Every error is a
        :class:`~atoll.protocol.errors.ConfigError` that starts with ``source``.
        """
        if not isinstance(text, str):
            raise ConfigError(f"{source}: a manifest is TOML text, not {type(text).__name__}")
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{source}: not valid TOML: {e}") from e
        tables = _TABLES
        scalars = list(_top_level_keys())
        values: dict[str, Any] = {}
        try:
            for key, value in document.items():
                if key in tables:
                    values[key] = _table(key, value, tables[key])
                elif key in scalars:
                    if isinstance(value, dict):
                        raise ConfigError(f"{key} must be a value, not a table")
                    values[key] = value
                else:
                    raise ConfigError(_unknown(key, "", scalars + list(tables)))
            if "name" not in values:
                raise ConfigError("the required key 'name' is missing")
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunManifest:
        """Read and parse the manifest file at ``path`` (UTF-8 TOML)."""
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"run manifest not found: {file}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read run manifest {file}: {e}") from e
        return cls.from_toml(text, source=str(file))

    def to_toml(self) -> str:
        """This manifest as TOML text; :meth:`from_toml` gives back an equal manifest."""
        lines = [f"# atoll run manifest, run id {self.run_id()}"]
        lines += [
            f"{key} = {_toml_value(getattr(self, key))}"
            for key in _top_level_keys()
            if key not in _OPTIONAL_KEYS or getattr(self, key) != _OPTIONAL_KEYS[key]
        ]
        for key in _TABLES:
            table = getattr(self, key)
            if _OPTIONAL_TABLES.get(key) == table:
                continue  # the default: a manifest without the table
            lines += ["", f"[{key}]"]
            lines += [f"{g.name} = {_toml_value(getattr(table, g.name))}" for g in fields(table)]
        return "\n".join(lines) + "\n"


def short_id(run_id: str) -> str:
    """The first 12 hex characters of a run id, for log lines."""
    if not isinstance(run_id, str):
        raise ConfigError(f"a run id is a string, not {type(run_id).__name__}")
    return run_id[:12]


# -- helpers ----------------------------------------------------------------------------------
_Table = type[GroupSettings] | type[Timeouts] | type[MembershipSettings] | type[RobustSettings]
_TABLES: dict[str, _Table] = {
    "group": GroupSettings,
    "timeouts": Timeouts,
    "membership": MembershipSettings,
    "robust": RobustSettings,
}
_OPTIONAL_TABLES: dict[str, object] = {
    "membership": MembershipSettings(),
    "robust": RobustSettings(),
}
"""tables left out of the run id and the TOML while they hold their defaults"""
_OPTIONAL_KEYS: dict[str, object] = {"owner": "", "batching": "windows"}
"""top-level keys left out of the run id and the TOML while they hold their defaults"""


@functools.cache
def _own_fields() -> tuple[Field[Any], ...]:
    """The fields :class:`RunManifest` declares itself (not inherited from OuterLoop)."""
    outer = {f.name for f in fields(OuterLoop)}
    return tuple(f for f in fields(RunManifest) if f.name not in outer)


@functools.cache
def _top_level_keys() -> tuple[str, ...]:
    """The manifest's top-level keys in the order :meth:`RunManifest.to_toml` writes them:
    the run's own (name first), then the outer loop's."""
    own = tuple(f.name for f in _own_fields() if f.name not in _TABLES)
    return own + tuple(f.name for f in fields(OuterLoop))


def _canonical(obj: Any) -> dict[str, Any]:
    """The fields of a dataclass as a dict with sorted keys, nested tables included."""
    out: dict[str, Any] = {}
    for name in sorted(f.name for f in fields(obj)):
        value = getattr(obj, name)
        out[name] = _canonical(value) if is_dataclass(value) else value
    return out


def _table(key: str, value: object, cls: _Table) -> object:
    """Build the settings of the ``[key]`` table from its parsed TOML value."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a table ([{key}]), not {_describe(value)}")
    known = [f.name for f in fields(cls)]
    for inner, item in value.items():
        if inner not in known:
            raise ConfigError(_unknown(inner, f"{key}.", known))
        if isinstance(item, dict):
            raise ConfigError(f"{key}.{inner} must be a value, not a table")
    return cls(**value)


def _unknown(key: str, prefix: str, known: list[str]) -> str:
    """The message for an unknown key, with the closest known name when there is one."""
    message = f"unknown key {prefix + key!r}"
    if not prefix:
        for table, cls in _TABLES.items():
            if key in (f.name for f in fields(cls)):
                return f"{message}; it belongs in the [{table}] table"
    elif key in (f.name for f in fields(RunManifest)):
        return f"{message}; {key!r} is a top-level key, not part of [{prefix[:-1]}]"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"{message}; did you mean {prefix + close[0]!r}?"
    return f"{message}; known keys: {', '.join(known)}"


def _toml_value(value: object) -> str:
    """One value as TOML (the manifest holds bool, int, float, str and tuples of str)."""
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same double
    if isinstance(value, str):
        return _toml_string(value)
    raise AssertionError(f"no TOML form for {value!r}")  # pragma: no cover


_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _toml_string(value: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for char in value:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
