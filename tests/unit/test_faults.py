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
    "spec", ["kill", "kill:start:0", "pause:start:0:1", "kill:middle:0:1", "stop:start:a:1"]
)
def test_a_malformed_spec_says_what_is_expected(spec: str) -> None:
    with pytest.raises(ConfigError, match="fault"):
        parse_fault(spec)


def test_the_hook_reaches_the_fragments_rounds_from_the_slot_on() -> None:
    assert parse_fault("") is None
    hook = parse_fault("stop:parts_sent:1:3")
    assert hook is not None
    assert hook(0, 5) is None  # another fragment
    assert hook(1, 2) is None  # an earlier slot
    assert hook(1, 3) is not None and hook(1, 7) is not None


SCRIPT = """
import logging, sys
from atoll.node.net.faults import parse_fault
logging.basicConfig(level=logging.WARNING)
hook = parse_fault(sys.argv[1])(0, 4)
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
        assert f"fragment 0 slot 4: {'killing' if action == 'kill' else 'freezing'}" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
