"""Fragment planner: which tensors of the model are synchronised together.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) splits the model into ``P``
fragments of whole transformer blocks and syncs one fragment at a time, so the bandwidth
peak of DiLoCo (arXiv 2311.08105) is spread over the ``H`` inner steps. The paper keeps
three blocks per fragment at every scale and found the *strided* assignment (fragment
``p`` holds blocks ``p, p+P, p+2P, ...``) better than the sequential one on both loss and
compute utilisation, so strided is the default here.

The paper does not say where the tensors outside the block stack go (embeddings, final
norm, output head). :func:`plan_fragments` offers three rules through ``extras``:

- ``"own"``   (default) they form one more fragment, appended last (index ``P``);
- ``"first"`` they are folded into fragment 0;
- ``"last"``  they are folded into fragment ``P - 1``.

For models that are not a stack of blocks, :func:`plan_balanced` packs whole tensors into
fragments of similar byte size, in the manner of the "balanced tensor fragmentation" of
Decoupled DiLoCo (arXiv 2604.21428). :func:`plan_fragments` never falls back to it
silently: a model without any block raises :class:`~atoll.protocol.errors.ConfigError`
that names :func:`plan_balanced`, so the choice of ``num_fragments`` stays the caller's.

Every plan is deterministic: the same specs in the same order give the same plan on every
peer, which the peers rely on when they exchange a fragment by its index.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from atoll.protocol.errors import ConfigError

__all__ = [
    "EXTRAS_RULES",
    "Fragment",
    "FragmentPlan",
    "TensorSpec",
    "plan_balanced",
    "plan_fragments",
]

#: The accepted values of ``plan_fragments(extras=...)``.
EXTRAS_RULES: tuple[str, ...] = ("own", "first", "last")

_FP32_BYTES = 4


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One trainable tensor, as the planner sees it.

    ``block`` is the index of the transformer block that holds the tensor, or ``None``
    for tensors outside the block stack (embeddings, final norm, output head, ...).
    """

    name: str
    shape: tuple[int, ...]
    block: int | None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.shape, tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.shape
        ):
            raise ConfigError(
                f"tensor {self.name!r}: shape must be a tuple of ints >= 0, got {self.shape!r}"
            )
        if self.block is not None and (
            not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 0
        ):
            raise ConfigError(
                f"tensor {self.name!r}: block must be None or an int >= 0, got {self.block!r}"
            )

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar, shape ``()``)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor as fp32, the precision of the global copy."""
        return _FP32_BYTES * self.numel


@dataclass(frozen=True, slots=True)
class Fragment:
    """A set of whole tensors that are synchronised together.

    ``names`` are in model order (the order the specs were given); ``blocks`` are the
    indices of the transformer blocks the fragment holds, sorted (empty for a fragment of
    non-block tensors only).
    """

    index: int
    names: tuple[str, ...]
    numel: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FragmentPlan:
    """The fragments of one model, indexed ``0 .. len(plan) - 1``.

    Construction checks that indices run in order, that no fragment is empty and that no
    tensor appears twice.
    """

    fragments: tuple[Fragment, ...]
    _owner: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.fragments:
            raise ConfigError("a fragment plan needs at least one fragment")
        owner: dict[str, int] = {}
        for i, frag in enumerate(self.fragments):
            if frag.index != i:
                raise ConfigError(f"fragment at position {i} has index {frag.index}")
            if not frag.names:
                raise ConfigError(f"fragment {i} is empty")
            for name in frag.names:
                if name in owner:
                    raise ConfigError(f"tensor {name!r} is in fragments {owner[name]} and {i}")
                owner[name] = i
        object.__setattr__(self, "_owner", owner)

    def __len__(self) -> int:
        return len(self.fragments)

    def __iter__(self) -> Iterator[Fragment]:
        return iter(self.fragments)

    def __getitem__(self, index: int) -> Fragment:
        return self.fragments[index]

    def fragment_of(self, name: str) -> int:
        """Index of the fragment holding tensor ``name``; ConfigError if none does."""
        try:
            return self._owner[name]
        except KeyError:
            raise ConfigError(f"tensor {name!r} is in no fragment of this plan") from None

    def describe(self) -> str:
        """One line per fragment: index, blocks held, number of tensors, elements."""
        lines = []
        for frag in self.fragments:
            blocks = ",".join(str(b) for b in frag.blocks) if frag.blocks else "-"
            lines.append(
                f"fragment {frag.index}: blocks [{blocks}], "
                f"{len(frag.names)} tensors, {frag.numel} params"
            )
        return "\n".join(lines)


def _check_specs(specs: Sequence[TensorSpec]) -> None:
    if not specs:
        raise ConfigError("no tensors to plan")
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise ConfigError(f"expected TensorSpec, got {type(spec).__name__}")
        if spec.name in seen:
            raise ConfigError(f"duplicate tensor name {spec.name!r}")
        seen.add(spec.name)


def _build(specs: Sequence[TensorSpec], assignment: Sequence[int], count: int) -> FragmentPlan:
    """Make a plan from ``assignment[i]`` = fragment of ``specs[i]``, keeping model order."""
    members: list[list[TensorSpec]] = [[] for _ in range(count)]
    for spec, frag in zip(specs, assignment, strict=True):
        members[frag].append(spec)
    fragments = tuple(
        Fragment(
            index=i,
            names=tuple(s.name for s in group),
            numel=sum(s.numel for s in group),
            blocks=tuple(sorted({s.block for s in group if s.block is not None})),
        )
        for i, group in enumerate(members)
    )
    return FragmentPlan(fragments)


def plan_fragments(
    specs: Sequence[TensorSpec],
    *,
    blocks_per_fragment: int = 3,
    extras: str = "own",
    strided: bool = True,
) -> FragmentPlan:
    """Assign whole transformer blocks to fragments (Streaming DiLoCo, arXiv 2501.18512).

    With ``n`` blocks (their indices must be exactly ``0 .. n-1``) there are
    ``P = ceil(n / blocks_per_fragment)`` block fragments. Strided (the default, and the
    better option in the paper): block ``b`` goes to fragment ``b mod P``. Sequential:
    block ``b`` goes to fragment ``b // blocks_per_fragment``. Tensors without a block
    follow the ``extras`` rule (see the module docstring); with ``"own"`` and no such
    tensor, no extra fragment is made.

    Raises ConfigError for duplicate names, a gap in the block indices, an unknown
    ``extras`` rule, ``blocks_per_fragment < 1``, or a model without blocks (use
    :func:`plan_balanced` for that).
    """
    _check_specs(specs)
    if isinstance(blocks_per_fragment, bool) or not isinstance(blocks_per_fragment, int):
        raise ConfigError(f"blocks_per_fragment must be an int, got {blocks_per_fragment!r}")
    if blocks_per_fragment < 1:
        raise ConfigError(f"blocks_per_fragment must be >= 1, got {blocks_per_fragment}")
    if extras not in EXTRAS_RULES:
        raise ConfigError(f"unknown extras rule {extras!r}; expected one of {EXTRAS_RULES}")

    block_ids = {s.block for s in specs if s.block is not None}
    if not block_ids:
        raise ConfigError(
            "no tensor belongs to a transformer block; plan this model with "
            "plan_balanced(specs, num_fragments) instead"
        )
    n = len(block_ids)
    if block_ids != set(range(n)):
        missing = sorted(set(range(max(block_ids) + 1)) - block_ids)
        raise ConfigError(
            f"block indices must be exactly 0..{n - 1}; missing {missing[:8]}"
            + ("..." if len(missing) > 8 else "")
        )

    num_block_frags = math.ceil(n / blocks_per_fragment)
    has_extras = any(s.block is None for s in specs)
    if extras == "own":
        extras_frag = num_block_frags
    elif extras == "first":
        extras_frag = 0
    else:
        extras_frag = num_block_frags - 1
    count = num_block_frags + (1 if extras == "own" and has_extras else 0)

    assignment: list[int] = []
    for spec in specs:
        if spec.block is None:
            assignment.append(extras_frag)
        elif strided:
            assignment.append(spec.block % num_block_frags)
        else:
            assignment.append(spec.block // blocks_per_fragment)
    return _build(specs, assignment, count)


def plan_balanced(specs: Sequence[TensorSpec], num_fragments: int) -> FragmentPlan:
    """Pack whole tensors into ``num_fragments`` fragments of similar byte size.

    The "balanced tensor fragmentation" of Decoupled DiLoCo (arXiv 2604.21428), for models
    that are not a stack of blocks: a greedy bin packing that takes tensors largest first
    (ties: model order) and puts each into the currently lightest fragment (ties: lowest
    index). The first ``num_fragments`` tensors each open their own fragment, so no
    fragment stays empty even when some tensors have zero elements. Names inside a
    fragment keep model order. The result is deterministic.

    Raises ConfigError when ``num_fragments < 1`` or exceeds the number of tensors, or
    for duplicate names.
    """
    _check_specs(specs)
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int):
        raise ConfigError(f"num_fragments must be an int, got {num_fragments!r}")
    if num_fragments < 1:
        raise ConfigError(f"num_fragments must be >= 1, got {num_fragments}")
    if num_fragments > len(specs):
        raise ConfigError(
            f"num_fragments={num_fragments} exceeds the number of tensors ({len(specs)}); "
            "every fragment needs at least one whole tensor"
        )

    order = sorted(range(len(specs)), key=lambda i: (-specs[i].nbytes, i))
    assignment = [0] * len(specs)
    for rank, i in enumerate(order[:num_fragments]):
        assignment[i] = rank
    # (load in bytes, fragment index): the heap minimum is the lightest fragment, lowest
    # index first among equals.
    heap = [(specs[i].nbytes, rank) for rank, i in enumerate(order[:num_fragments])]
    heapq.heapify(heap)
    for i in order[num_fragments:]:
        load, target = heapq.heappop(heap)
        assignment[i] = target
        heapq.heappush(heap, (load + specs[i].nbytes, target))
    return _build(specs, assignment, num_fragments)
