"""Numeric regression: small fixed runs against recorded figures.

Bytes must match exactly (they follow from the schedule and the codec). Losses may move
a little between CPUs and torch builds (float summation order), so they get a tolerance;
a real change of the algorithm moves them by far more. Regenerate after an intended
change with ``ATOLL_REGEN_GOLDEN=1 pytest tests/integration/test_golden.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from atoll.node.data import stdlib_corpus
from atoll.node.simulate import SimConfig, simulate

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "micro_runs.json"
RUNS = {
    "ddp": SimConfig(algo="ddp"),
    "diloco": SimConfig(algo="diloco", H=10),
    "streaming": SimConfig(algo="streaming", H=10, blocks_per_fragment=1),
    "streaming-ef-rda": SimConfig(
        algo="streaming", H=10, blocks_per_fragment=1, error_feedback=True, aggregation="rda"
    ),
}
COMMON = {
    "preset": "micro",
    "replicas": 2,
    "steps": 40,
    "batch_size": 8,
    "warmup": 4,
    "lr": 3e-3,
    "eval_batches": 4,
    "seed": 1,
}
pytestmark = pytest.mark.integration


def test_small_runs_match_the_golden_figures() -> None:
    corpus = stdlib_corpus()
    got = {}
    for name, cfg in RUNS.items():
        r = simulate(cfg.with_(**COMMON), corpus=corpus)
        got[name] = {"eval_loss": r.eval_loss, "bytes_per_replica": r.bytes_per_replica}
    if os.environ.get("ATOLL_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=2) + "\n")
    want = json.loads(GOLDEN.read_text())
    for name, fig in want.items():
        assert got[name]["bytes_per_replica"] == fig["bytes_per_replica"], name
        assert got[name]["eval_loss"] == pytest.approx(fig["eval_loss"], rel=5e-3), name
