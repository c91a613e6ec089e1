"""Fault injection specs (atoll.node.net.faults): parsing, which rounds they reach, and a
real process that kills or freezes itself at its point."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atoll.node.net.faults import parse_fault
from atoll.protocol.errors import ConfigError


@pytest.mark.parametrize(
    "spec",
    [
        "kill",
        "kill:start:0",
        "pause:start:0:1",
        "kill:middle:0:1",
        "stop:start:a:1",
        "stop:start:0:1:x",
        "stop:start:0:1:3:4",
    ],
)
def test_a_malformed_spec_says_what_is_expected(spec: str) -> None:
    with pytest.raises(ConfigError, match="fault"):
        parse_fault(spec)


def test_the_hook_reaches_the_fragments_rounds_from_the_slot_on() -> None:
    assert parse_fault("") is None
    hook = parse_fault("stop:parts_sent:1:3")
    assert hook is not None
    assert hook(0, 5, 2) is None  # another fragment
    assert hook(1, 2, 2) is None  # an earlier slot
    assert hook(1, 3, 2) is not None and hook(1, 7, 2) is not None


def test_a_member_count_reaches_only_rounds_that_large() -> None:
    hook = parse_fault("stop:start:0:6:3")
    assert hook is not None
    assert hook(0, 6, 2) is None and hook(0, 9, 2) is None  # pairs: not reached
    assert hook(0, 7, 3) is not None and hook(0, 8, 4) is not None


SCRIPT = """
import logging, sys
from atoll.node.net.faults import parse_fault
logging.basicConfig(level=logging.WARNING)
hook = parse_fault(sys.argv[1])(0, 4, 3)
hook("start")          # not its point: nothing happens
print("before", flush=True)
hook("part_sent")
print("after", flush=True)
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("action", ["kill", "stop"])
def test_a_process_kills_or_freezes_itself_at_its_point(action: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, f"{action}:part_sent:0:2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if action == "kill":
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == -signal.SIGKILL
        else:
            deadline = time.monotonic() + 60
            while _state(proc.pid) != "T":  # stopped, not gone: a silent peer
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            proc.kill()
            out, err = proc.communicate(timeout=60)
        assert out == "before\n"
        doing = "killing" if action == "kill" else "freezing"
        assert f"fragment 0 slot 4 (3 members): {doing}" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
