"""bench/churn.py --quick end to end: a failure-free run and a churn run of 3 nodes (one
late joiner, the two others killed and restarted once each, one slow node) on 127.0.0.1.

The targets themselves (goodput, loss) are the benchmark's to report, not this test's:
it checks that the JSON has its figures, that no process hung, that every restart
resumed the checkpoint the bench found and that every node finished its run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "churn.py"


def test_bench_churn_quick_reports_every_figure_and_no_hang(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    argv = [sys.executable, str(SCRIPT), "--quick", "--workdir", str(tmp_path / "w")]
    argv += ["--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=580, check=False)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in (
        "goodput",
        "eval_loss",
        "per_node",
        "rejoins",
        "rejoin_s",
        "catch_up_bytes",
        "hangs",
        "checkpoint_resumes",
        "one_copy",
        "synchronous_model",
        "targets",
        "schedule",
        "machine",
    ):
        assert key in r, key
    assert r["hangs"] == {"failure-free": [], "churn": []}, r["hangs"]
    assert r["targets"]["no hang"]["pass"]
    ran = r["targets"]["the runs and the schedule ran"]
    assert ran["pass"], (ran["detail"], r["schedule"])
    assert len(r["per_node"]) == 3
    for n in r["per_node"]:
        assert n["finished"], n
        assert n["goodput"] is not None and n["goodput"] > 0, n
        for k in ("rounds_applied", "rounds_failed", "rounds_alone", "rebases", "live_s"):
            assert isinstance(n[k], (int, float)), (k, n)
    kinds = sorted(j["kind"] for j in r["rejoins"])
    assert kinds == ["late join", "restart", "restart"], r["rejoins"]
    for j in r["rejoins"]:
        assert j["to_first_step_s"] is not None and j["catch_up_bytes_down"] is not None, j
    resumes = r["checkpoint_resumes"]
    assert len(resumes) == 2 and all(x["ok"] for x in resumes), resumes
    assert all(x["resumed"] and x["resumed"].startswith("ckpt-") for x in resumes), resumes
    assert r["synchronous_model"]["modelled"] is True
    assert r["eval_loss"]["failure_free"] and r["eval_loss"]["churn"]
    assert "goodput >= 92%" in r["targets"]
