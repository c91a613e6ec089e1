#!/usr/bin/env python3
"""Print a markdown table from the JSON files of ``bench/parity.py``.

    python bench/report.py runs/parity-full.json [more.json ...]

Loss is relative to the ddp run with the same token budget found in the same files.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def rows(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run for doc in docs for run in doc["runs"]]


def table(runs: list[dict[str, Any]]) -> str:
    ddp = {r["tokens"]: r for r in runs if r["algo"] == "ddp"}
    out = [
        "| run | tokens | eval loss | vs ddp | bytes sent / replica | ddp bytes ÷ these | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        base = ddp.get(r["tokens"])
        rel = (
            f"{(r['eval_loss'] / base['eval_loss'] - 1) * 100:+.1f}%"
            if base and r is not base
            else "-"
        )
        ratio = f"{r['bytes_ratio']:.1f}x" if r.get("bytes_ratio") else "1x"
        out.append(
            f"| {r['label']} | {r['tokens']:,} | {r['eval_loss']:.4f} | {rel} | "
            f"{r['bytes_per_replica'] / 1e6:,.2f} MB | {ratio} | {r['wall_s']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    docs = []
    for path in argv:
        with open(path) as f:
            docs.append(json.load(f))
    print(table(rows(docs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
