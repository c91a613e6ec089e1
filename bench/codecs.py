#!/usr/bin/env python3
"""Encode and decode speed of atoll's wire codecs on one large float32 vector.

For each codec (all of :data:`~atoll.protocol.codecs.CODEC_NAMES` unless ``--codecs``
names some) the script times ``encode`` and ``decode`` of NUMEL standard-normal float32
values (seed 0), best of ``--repeat`` runs each, in this process alone. With ``--memory``
it then measures, in a separate untimed run under :mod:`tracemalloc` (numpy reports its
buffers there), the peak of memory allocated during one encode and one decode beyond
their result: the large temporaries that cost page faults when several processes share
the cores.

    python bench/codecs.py --numel 25000000 --json runs/codecs.json
    python bench/codecs.py --numel 1000000 --codecs e3m0 e3m0-sr --memory

The JSON report maps each codec name to ``encode_s``, ``decode_s`` (best times),
``encode_mb_s`` and ``decode_mb_s`` (float32 megabytes per second), ``payload_bytes``
and, with ``--memory``, ``encode_peak_mb`` and ``decode_peak_mb``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from atoll.protocol.codecs import CODEC_NAMES, make_codec


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest wall time of ``repeat`` calls of ``fn``."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_mb(fn: Callable[[], object]) -> float:
    """Peak traced memory (MB) while ``fn`` runs, its result excluded once it returns."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
        size = getattr(result, "nbytes", None)
        if size is None and isinstance(result, bytes | bytearray):
            size = len(result)
        del result
    finally:
        tracemalloc.stop()
    return max(0, peak - int(size or 0)) / 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=25_000_000, help="values per vector")
    p.add_argument("--codecs", nargs="+", default=list(CODEC_NAMES), choices=CODEC_NAMES)
    p.add_argument("--block", type=int, default=128, help="block size of int8 and e3m0")
    p.add_argument("--repeat", type=int, default=3, help="runs per timing (best is kept)")
    p.add_argument("--memory", action="store_true", help="also measure peak temporaries")
    p.add_argument("--json", metavar="FILE", help="write the report here")
    args = p.parse_args(argv)

    x = np.random.default_rng(0).standard_normal(args.numel, dtype=np.float32)
    mb = x.nbytes / 1e6
    results: dict[str, dict[str, Any]] = {}
    for name in args.codecs:
        codec = make_codec(name, block=args.block)
        seed = np.random.default_rng(1)
        payload = codec.encode(x, rng=seed)
        enc = best_of(lambda c=codec: c.encode(x, rng=np.random.default_rng(1)), args.repeat)
        dec = best_of(lambda c=codec, b=payload: c.decode(b, args.numel), args.repeat)
        row: dict[str, Any] = {
            "encode_s": round(enc, 4),
            "decode_s": round(dec, 4),
            "encode_mb_s": round(mb / enc, 1),
            "decode_mb_s": round(mb / dec, 1),
            "payload_bytes": len(payload),
        }
        if args.memory:
            row["encode_peak_mb"] = round(
                peak_mb(lambda c=codec: c.encode(x, rng=np.random.default_rng(1))), 1
            )
            row["decode_peak_mb"] = round(
                peak_mb(lambda c=codec, b=payload: c.decode(b, args.numel)), 1
            )
        results[name] = row
        extra = ""
        if args.memory:
            extra = f"  peak temp enc {row['encode_peak_mb']:7.1f} MB"
            extra += f"  dec {row['decode_peak_mb']:7.1f} MB"
        print(f"{name:8s} encode {enc:7.3f} s  decode {dec:7.3f} s{extra}", flush=True)

    report = {
        "numel": args.numel,
        "block": args.block,
        "repeat": args.repeat,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "codecs": results,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
