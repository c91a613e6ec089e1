"""Compute utilisation of a local swarm: does training wait on the network?

Runs ``atoll demo``'s swarm (a bootstrap peer and N ``atoll node`` processes, each a
trainer plus its network process) and reports, per node, the compute utilisation (time in
forward, backward and optimizer steps divided by the wall time of the training loop, so
time blocked on the network, on matchmaking or on anything else shows) and tokens/s.

    python bench/swarm.py --json runs/swarm-loopback.json
    wanlab up 4 --rate 50mbit --delay 40ms        # as root
    python bench/swarm.py --wanlab /path/to/wanlab --json runs/swarm-wan.json

wanlab is a separate network-namespace lab, not part of atoll: ``wanlab exec I CMD...``
runs CMD in namespace I and ``wanlab ip I`` prints its address (:mod:`atoll.node.demo`).
With ``--wanlab`` node i runs inside the lab's namespace i (rate, delay and loss as the lab
was brought up); the bootstrap shares node 0's namespace. The JSON holds the per-node
figures, their minimum and mean, the demo's summary and the machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from atoll.node.demo import DemoConfig, run_demo

log = logging.getLogger("bench.swarm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--codec", default="e3m0")
    ap.add_argument("--wanlab", help="path of the wanlab tool (the lab must be up)")
    ap.add_argument("--timeouts-scale", type=float, default=1.0)
    ap.add_argument("--workdir", help="keep the nodes' files and logs here")
    ap.add_argument(
        "--ahead-s",
        type=float,
        default=None,
        help="the nodes' --ahead-s (seconds before a sync its group starts forming; "
        "0: each sync forms its own; default: the node's default)",
    )
    ap.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="I:FACTOR",
        help="node I trains FACTOR times slower (repeatable; e.g. 2:6, a laptop beside GPUs)",
    )
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    try:
        slowdown = {int(i): float(f) for i, f in (x.split(":", 1) for x in args.slow)}
    except ValueError:
        ap.error(f"--slow takes I:FACTOR, e.g. 2:6, not {args.slow}")
    if args.ahead_s is not None:
        os.environ["ATOLL_AHEAD_S"] = str(args.ahead_s)  # the nodes inherit it
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = DemoConfig(
        nodes=args.nodes,
        steps=args.steps,
        preset=args.preset,
        H=args.H,
        tau=args.tau,
        codec=args.codec,
        batch_size=args.batch_size,
        workdir=args.workdir,
        wanlab=args.wanlab,
        timeouts_scale=args.timeouts_scale,
        refresh_s=10.0,
        slowdown=slowdown,
    )
    t0 = time.time()
    summary = run_demo(cfg)
    nodes: list[dict[str, Any]] = summary["nodes"]
    util = [n["utilisation"] for n in nodes if n["utilisation"] is not None]
    tps = [n["tokens_per_s"] for n in nodes if n["tokens_per_s"] is not None]
    result = {
        "bench": "swarm",
        "command": " ".join([sys.executable, *sys.argv]),
        "mode": "wanlab" if args.wanlab else "loopback",
        "started": t0,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "utilisation": {n["name"]: n["utilisation"] for n in nodes},
        "tokens_per_s": {n["name"]: n["tokens_per_s"] for n in nodes},
        "min_utilisation": min(util) if util else None,
        "mean_utilisation": sum(util) / len(util) if util else None,
        "mean_tokens_per_s": sum(tps) / len(tps) if tps else None,
        "ahead_s": args.ahead_s,
        "slowdown": slowdown,
        "net_wait_share": {
            n["name"]: round(n["net_wait_s"] / n["wall_s"], 3)
            for n in nodes
            if n.get("net_wait_s") is not None and n.get("wall_s")
        },
        "rounds_ahead": {n["name"]: n.get("rounds_ahead") for n in nodes},
        "summary": summary,
    }
    print(
        f"\n{result['mode']}: compute utilisation min {result['min_utilisation']:.3f} "
        f"mean {result['mean_utilisation']:.3f}; tokens/s per node "
        f"{result['mean_tokens_per_s']:.0f}"
        if util
        else "no node finished"
    )
    for n in nodes:
        print(
            f"  {n['name']}: utilisation {n['utilisation']}, net wait {n['net_wait_s']} s, "
            f"rounds {n['rounds_applied']} applied / {n['rounds_failed']} failed / "
            f"{n['rounds_alone']} alone ({n.get('rounds_ahead')} in groups formed ahead), "
            f"rebases {n['rebases']}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
