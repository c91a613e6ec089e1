"""Tests of the fragment planner (Streaming DiLoCo 2.1, balanced fragmentation)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.protocol.errors import ConfigError
from atoll.protocol.fragments import (
    Fragment,
    FragmentPlan,
    TensorSpec,
    plan_balanced,
    plan_fragments,
)

FAST = settings(max_examples=100, deadline=None)


def gpt_specs(n_layers: int, d: int = 8) -> list[TensorSpec]:
    """A small GPT-like spec list in model order: embedding, blocks, final norm, head."""
    specs = [TensorSpec("tok_emb.weight", (50, d), None)]
    for b in range(n_layers):
        specs += [
            TensorSpec(f"blocks.{b}.ln1.weight", (d,), b),
            TensorSpec(f"blocks.{b}.attn.qkv.weight", (3 * d, d), b),
            TensorSpec(f"blocks.{b}.attn.proj.weight", (d, d), b),
            TensorSpec(f"blocks.{b}.ln2.weight", (d,), b),
            TensorSpec(f"blocks.{b}.mlp.fc.weight", (4 * d, d), b),
            TensorSpec(f"blocks.{b}.mlp.proj.weight", (d, 4 * d), b),
        ]
    specs += [TensorSpec("ln_f.weight", (d,), None), TensorSpec("head.weight", (50, d), None)]
    return specs


def assert_partition(plan: FragmentPlan, specs: list[TensorSpec]) -> None:
    names = [n for f in plan.fragments for n in f.names]
    assert sorted(names) == sorted(s.name for s in specs)
    assert len(names) == len(set(names))
    order = {s.name: i for i, s in enumerate(specs)}
    by_name = {s.name: s for s in specs}
    for i, frag in enumerate(plan.fragments):
        assert frag.index == i
        assert frag.names
        assert [order[n] for n in frag.names] == sorted(order[n] for n in frag.names)
        assert frag.numel == sum(by_name[n].numel for n in frag.names)
        blocks = {by_name[n].block for n in frag.names} - {None}
        assert frag.blocks == tuple(sorted(b for b in blocks if b is not None))
        for n in frag.names:
            assert plan.fragment_of(n) == i


def test_tensor_spec_sizes() -> None:
    s = TensorSpec("w", (3, 4), 0)
    assert s.numel == 12 and s.nbytes == 48
    assert TensorSpec("scalar", (), None).numel == 1


@pytest.mark.parametrize(
    ("name", "shape", "block"),
    [("", (1,), None), ("w", (-1,), None), ("w", (2,), -1), ("w", [2], None)],
)
def test_tensor_spec_rejects_bad_fields(name: str, shape: Any, block: Any) -> None:
    with pytest.raises(ConfigError):
        TensorSpec(name, shape, block)


def test_paper_layout_24_layers_strided() -> None:
    specs = gpt_specs(24)
    plan = plan_fragments(specs)
    assert len(plan) == 9  # P = 8 block fragments + 1 for the extras
    for p in range(8):
        assert plan.fragments[p].blocks == (p, p + 8, p + 16)
        assert len(plan.fragments[p].names) == 18
    extras = plan.fragments[8]
    assert extras.blocks == ()
    assert extras.names == ("tok_emb.weight", "ln_f.weight", "head.weight")
    assert_partition(plan, specs)


def test_sequential_assignment() -> None:
    specs = gpt_specs(7)
    plan = plan_fragments(specs, strided=False, blocks_per_fragment=3)
    assert [f.blocks for f in plan.fragments] == [(0, 1, 2), (3, 4, 5), (6,), ()]
    assert_partition(plan, specs)


def test_strided_uneven() -> None:
    plan = plan_fragments(gpt_specs(7), blocks_per_fragment=3)
    assert [f.blocks for f in plan.fragments] == [(0, 3, 6), (1, 4), (2, 5), ()]


@pytest.mark.parametrize(("extras", "target"), [("first", 0), ("last", 3)])
def test_extras_folded(extras: str, target: int) -> None:
    specs = gpt_specs(12)
    plan = plan_fragments(specs, extras=extras)
    assert len(plan) == 4
    for name in ("tok_emb.weight", "ln_f.weight", "head.weight"):
        assert plan.fragment_of(name) == target
    frag = plan.fragments[target]
    assert frag.names[0] == "tok_emb.weight"  # model order kept
    assert frag.names[-2:] == ("ln_f.weight", "head.weight")
    assert_partition(plan, specs)


def test_own_without_extras_adds_no_empty_fragment() -> None:
    specs = [s for s in gpt_specs(6) if s.block is not None]
    plan = plan_fragments(specs)
    assert len(plan) == 2
    assert_partition(plan, specs)


def test_one_fragment_per_block() -> None:
    plan = plan_fragments(gpt_specs(5), blocks_per_fragment=1, extras="last")
    assert [f.blocks for f in plan.fragments] == [(0,), (1,), (2,), (3,), (4,)]


def test_plan_fragments_errors() -> None:
    specs = gpt_specs(3)
    with pytest.raises(ConfigError, match="extras"):
        plan_fragments(specs, extras="middle")
    with pytest.raises(ConfigError):
        plan_fragments(specs, blocks_per_fragment=0)
    with pytest.raises(ConfigError, match="duplicate"):
        plan_fragments([*specs, specs[1]])
    gap = [s for s in specs if s.block != 1]
    with pytest.raises(ConfigError, match=r"0\.\.1"):
        plan_fragments(gap)
    with pytest.raises(ConfigError, match="plan_balanced"):
        plan_fragments([TensorSpec("a", (3,), None), TensorSpec("b", (4,), None)])
    with pytest.raises(ConfigError):
        plan_fragments([])


def test_fragment_of_unknown_and_describe() -> None:
    plan = plan_fragments(gpt_specs(6))
    with pytest.raises(ConfigError):
        plan.fragment_of("nope")
    lines = plan.describe().splitlines()
    assert len(lines) == len(plan) == 3
    assert lines[0].startswith("fragment 0: blocks [0,2,4], 18 tensors")
    assert lines[2].startswith("fragment 2: blocks [-], 3 tensors")
    assert list(plan) == list(plan.fragments)
    assert plan[1] is plan.fragments[1]


def test_plan_validation() -> None:
    a = Fragment(0, ("x",), 1, ())
    with pytest.raises(ConfigError):
        FragmentPlan(())
    with pytest.raises(ConfigError):
        FragmentPlan((a, Fragment(1, ("x",), 1, ())))
    with pytest.raises(ConfigError):
        FragmentPlan((a, Fragment(1, (), 0, ())))
    with pytest.raises(ConfigError):
        FragmentPlan((Fragment(1, ("x",), 1, ()),))


def test_plans_are_deterministic_and_hashable() -> None:
    specs = gpt_specs(9)
    assert plan_fragments(specs) == plan_fragments(list(specs))
    assert hash(plan_fragments(specs)) == hash(plan_fragments(specs))
    assert plan_balanced(specs, 4) == plan_balanced(specs, 4)


def test_balanced_example() -> None:
    specs = [
        TensorSpec("a", (10,), None),
        TensorSpec("b", (40,), None),
        TensorSpec("c", (30,), None),
        TensorSpec("d", (20,), None),
        TensorSpec("e", (10,), None),
    ]
    plan = plan_balanced(specs, 2)
    # Largest first, equal sizes in model order: b(40) -> 0, c(30) -> 1, d(20) -> 1 (30 < 40),
    # a(10) -> 0 (40 < 50), e(10) -> 0 (tie at 50: lowest index).
    assert plan.fragments[0].names == ("a", "b", "e")
    assert plan.fragments[1].names == ("c", "d")
    assert [f.numel for f in plan.fragments] == [60, 50]
    assert_partition(plan, specs)


def test_balanced_errors_and_zero_sized() -> None:
    specs = [TensorSpec("a", (4,), None), TensorSpec("b", (0,), None), TensorSpec("c", (0,), 0)]
    with pytest.raises(ConfigError):
        plan_balanced(specs, 4)
    with pytest.raises(ConfigError):
        plan_balanced(specs, 0)
    plan = plan_balanced(specs, 3)  # zero-sized tensors still open their own fragment
    assert [f.names for f in plan.fragments] == [("a",), ("b",), ("c",)]
    assert plan.fragments[2].blocks == (0,)


spec_lists = st.lists(
    st.tuples(st.lists(st.integers(0, 40), min_size=0, max_size=3), st.integers(0, 3)),
    min_size=1,
    max_size=40,
).map(
    lambda rows: [
        TensorSpec(f"t{i}", tuple(shape), None if blk == 0 else blk - 1)
        for i, (shape, blk) in enumerate(rows)
    ]
)


@FAST
@given(specs=spec_lists, data=st.data())
def test_balanced_properties(specs: list[TensorSpec], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(specs)))
    plan = plan_balanced(specs, k)
    assert len(plan) == k
    assert_partition(plan, specs)
    # Greedy LPT bound: the heaviest fragment exceeds the lightest by at most the
    # largest tensor.
    loads = [4 * f.numel for f in plan.fragments]
    assert max(loads) - min(loads) <= max(s.nbytes for s in specs)
    assert plan == plan_balanced(list(specs), k)


@FAST
@given(
    n=st.integers(1, 30),
    per=st.integers(1, 6),
    extras=st.sampled_from(["own", "first", "last"]),
    strided=st.booleans(),
    with_extras=st.booleans(),
)
def test_block_plan_properties(
    n: int, per: int, extras: str, strided: bool, with_extras: bool
) -> None:
    specs = gpt_specs(n, d=2)
    if not with_extras:
        specs = [s for s in specs if s.block is not None]
    plan = plan_fragments(specs, blocks_per_fragment=per, extras=extras, strided=strided)
    p = -(-n // per)
    assert len(plan) == p + (1 if extras == "own" and with_extras else 0)
    assert_partition(plan, specs)
    held = sorted(b for f in plan.fragments for b in f.blocks)
    assert held == list(range(n))  # every block in exactly one fragment, whole
    for f in plan.fragments[:p]:
        assert 1 <= len(f.blocks) <= per
        if strided:
            assert all(b % p == f.index for b in f.blocks)
