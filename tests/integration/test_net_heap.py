"""keep_freed_memory: a process that reallocates a freed 100 MB buffer touches no new pages.

Each case runs in a fresh Python process (the malloc settings are process-wide), which
allocates, fills and frees a 100 MB array three times and reports the minor page faults
of the last two times.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import json, resource, sys
import numpy as np
from atoll.node.net.heap import keep_freed_memory

took = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(25 * 2**20, dtype=np.float32)
    a.fill(1.0)
    del a
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"took": took, "faults": faults[1:]}))
"""


def run(mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, object] = json.loads(done.stdout)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_buffers_are_reused_without_new_page_faults() -> None:
    default, kept = run("default"), run("keep")
    assert kept["took"] is True
    pages = 100 * 2**20 // 4096
    # by default each new 100 MB buffer is a fresh mapping: its pages fault in again
    # (fewer faults than pages where the kernel backs it with huge pages)
    assert min(default["faults"]) > 20  # type: ignore[type-var]
    # kept: the heap pages of the first buffer serve the next ones
    assert max(kept["faults"]) < pages // 100  # type: ignore[type-var]
