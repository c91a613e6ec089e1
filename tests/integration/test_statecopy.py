"""Multi-source state copies between real processes on 127.0.0.1 (bench/statesync.py):
a joiner copies a state of 12 MB from three donor processes, each piece checked against
the certified digest's piece list; and one donor SIGKILLs itself mid-copy, and the
joiner still ends with exactly the state (its digest), the others serving the rest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "statesync.py"


def _copy(tmp_path: Path, *extra: str) -> dict[str, object]:
    out = tmp_path / "report.json"
    argv = [sys.executable, str(SCRIPT), "--mb", "12", "--donors", "3", "--repeat", "1"]
    argv += ["--json", str(out), *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    [case] = report["cases"]
    assert case["ok"] and case["bytes"] == 12_000_036, case  # the digest matched
    return dict(case)


@pytest.mark.timeout(180)
def test_a_joiner_copies_one_state_from_three_donor_processes(tmp_path: Path) -> None:
    # each donor serves at most 8 MB/s, as over a link: unpaced on loopback, the first
    # donor to answer can send all 12 MB before a busy machine schedules the third's
    # answer to the piece-list request, and the copy then rightly ends without it
    case = _copy(tmp_path, "--serve-mbps", "8")
    assert case["donors_used"] == 3 and case["dropped"] == [], case


@pytest.mark.timeout(180)
def test_a_donor_sigkilled_mid_copy_leaves_the_joiner_with_the_right_state(
    tmp_path: Path,
) -> None:
    case = _copy(tmp_path, "--die-after", "2")
    dropped = case["dropped"]
    assert isinstance(dropped, list) and len(dropped) == 1, case
    assert dropped[0][1] is False, case  # unavailable, not hostile
