"""bench/allreduce.py end to end: 3 peer processes, 1 MB, 2 rounds (no hivemind)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "allreduce.py"
PEERS, MB, ROUNDS = 3, 1, 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["fp32", "e3m0"])
def test_bench_allreduce_reports_a_sound_round(codec: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = [sys.executable, str(SCRIPT), "--peers", str(PEERS), "--mb", str(MB)]
    argv += ["--rounds", str(ROUNDS), "--codec", codec, "--timeout", "60", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"atoll {codec}" in done.stdout  # the human table

    report = json.loads(out.read_text())
    assert report["codec"] == codec
    assert report["config"]["peers"] == PEERS
    for key in ("cpu_count", "python", "platform"):
        assert key in report["machine"]
    for key in ("round_s", "bytes_sent_per_peer", "cpu_s", "max_abs_error_per_round"):
        assert len(report[key]) == ROUNDS, key
    assert all(0 < t < 60 for t in report["round_s"])
    assert all(c >= 0 for c in report["cpu_s"])

    optimal = 2 * (PEERS - 1) / PEERS * report["encoded_bytes"]
    assert report["optimal_bytes_per_peer"] == pytest.approx(optimal)
    for sent in report["bytes_sent_per_peer"]:
        assert sent == pytest.approx(optimal, rel=0.10)

    err = report["max_abs_error"]
    if codec == "fp32":
        assert err < 1e-5
    else:
        # lossy, but within the codec's bound: each 4-bit quantization errs by at most
        # ~0.3 of its block's max |x|, and standard normal data stay below ~5
        assert 1e-3 < err < 2.5


def test_bench_allreduce_rejects_bad_arguments() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--peers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "allreduce.py: error: --peers must be between 2 and 64, not 1"


@pytest.mark.timeout(120)
def test_bench_allreduce_verify_owners_costs_one_more_reduce_scatter(tmp_path: Path) -> None:
    out = tmp_path / "verify.json"
    argv = [sys.executable, str(SCRIPT), "--verify-owners", "--verify-peers", "3,4"]
    argv += ["--mb", "0.25", "--rounds", "1", "--codec", "e3m0", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verified" in done.stdout
    report = json.loads(out.read_text())
    assert set(report["groups"]) == {"3", "4"}
    for n, group in report["groups"].items():
        predicted = group["predicted_payload_bytes"]
        for mode in ("plain", "verified"):
            assert group[mode]["payload_bytes_sent_per_member"] == [predicted[mode]]
        assert group["verified"]["messages_per_member"] == [4 * (int(n) - 1)]
        assert group["ratios"]["wire_bytes"] == pytest.approx(1.5, rel=0.05)
