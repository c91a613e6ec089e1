"""Load a script of ``bench/`` as a module (the benchmarks are scripts, not a package), for
the tests of their helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> Any:
    """``bench/<name>.py`` as the module ``bench_<name>`` (with ``bench/`` on the import
    path, as when the script runs, for the helpers it imports from its folder)."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module
    spec.loader.exec_module(module)
    return module
