#!/usr/bin/env python3
"""What a peer that goes silent in the middle of a round costs the others: measured
deadlines against the manifest's fixed ones.

Each case runs a bootstrap peer and three ``atoll node`` processes on 127.0.0.1 (the
tiny model, one torch thread each, syncs every 10 steps, two fragments). The victim's
network process freezes with SIGSTOP (``ATOLL_FAULT=stop:POINT:0:SLOT:3``: its
connections stay open and nothing answers, as over a link that went silent) in fragment
0's first round of all three nodes at or after ``--slot``, at ``POINT``:

- ``start``: before it sends any part. The survivors miss its parts: the *phase*
  deadline runs out.
- ``parts_sent``: once every part is out. The survivors reduce, then miss its reduced
  chunk: the *round* deadline runs out.

The same case runs with the node's measured deadlines (the default,
:mod:`atoll.protocol.deadlines`) and with ``--fixed-deadlines`` (the manifest's
``part_s`` and ``round_s``), one after the other in one invocation. Once the survivors
are ``--after`` steps past the frozen slot the victim is killed for good; they finish
their ``--steps`` and report.

Figures, per case (mean over the survivors that were in the victim's round):

- ``failed_sync_s``: the seconds of the survivors' sync at the frozen slot (matchmaking,
  mostly formed ahead, plus the round until its deadline ran out);
- ``to_next_applied_s``: from the freeze (the victim's log line) to each survivor's next
  applied round of any fragment;
- ``deadlines``: the phase and round deadlines the survivors logged when the round ran
  out at a measured deadline (none with fixed deadlines);
- ``rounds_applied``: the survivors' applied rounds over the run.

The comparison gives ``fixed / measured`` of both times.

    .venv/bin/python bench/deadlines.py --json runs/deadlines.json
    .venv/bin/python bench/deadlines.py --quick --json runs/deadlines-quick.json

Each node's log stays in ``--workdir`` (a temporary folder by default), named when a case
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from atoll.node.net.faults import descendants

log = logging.getLogger("bench.deadlines")

CLI = [sys.executable, "-m", "atoll.node.cli"]
H = 10
MANIFEST = """name = "deadlines-bench"
model = "tiny"
batch_size = 4
lr = 3e-3
warmup = 5
total_steps = 400
H = {H}
tau = 3
blocks_per_fragment = 2

[group]
min_quorum = 2
max_size = 8
grace_s = 3.0

[timeouts]
matchmaking_s = 6.0
part_s = {part_s}
round_s = {round_s}
apply_wait_s = 3.0
"""
FROZE = re.compile(r"fault injection: fragment 0 slot (\d+) \(\d+ members\): freezing")
RAN_OUT = re.compile(r"measured deadline \(([\d.]+) s phase, ([\d.]+) s round\)")


@dataclass
class Proc:
    """One ``atoll node`` process and what it reported."""

    name: str
    proc: subprocess.Popen[str]
    err: Path
    progress: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None

    def text(self) -> str:
        return self.err.read_text(errors="replace")


def _read(p: Proc) -> None:
    assert p.proc.stdout is not None
    for line in p.proc.stdout:
        with contextlib.suppress(json.JSONDecodeError):
            msg = json.loads(line)
            if "progress" in msg:
                p.progress = msg["progress"]
            elif "summary" in msg:
                p.summary = msg["summary"]


def _stamp(line: str) -> float | None:
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def _wait(cond: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise RuntimeError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.5)


class Case:
    """One bootstrap and three nodes in ``folder``; everything is killed on close."""

    def __init__(self, args: argparse.Namespace, folder: Path, point: str, fixed: bool) -> None:
        self.args = args
        self.folder = folder
        self.point = point
        self.fixed = fixed
        self.procs: list[Proc] = []
        self.boot: subprocess.Popen[str] | None = None
        folder.mkdir(parents=True, exist_ok=True)
        self.run = folder / "run.toml"
        self.run.write_text(MANIFEST.format(H=H, part_s=args.part_s, round_s=args.round_s))

    def start_bootstrap(self) -> str:
        addr_file = self.folder / "bootstrap.addr"
        self.boot = subprocess.Popen(
            [
                *CLI,
                "bootstrap",
                "--identity",
                str(self.folder / "bootstrap.key"),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--addr-file",
                str(addr_file),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(self.folder / "bootstrap.err").open("w"),
        )
        text = _wait(
            lambda: addr_file.exists() and addr_file.read_text().strip(),
            120,
            "the bootstrap's address",
        )
        return str(text).split()[0]

    def start_node(self, name: str, addr: str, steps: int, env: dict[str, str]) -> Proc:
        err = self.folder / f"{name}.err"
        args = [
            *CLI,
            "-vv" if self.args.debug else "-v",
            "node",
            "--run",
            str(self.run),
            "--identity",
            str(self.folder / f"{name}.key"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--join",
            addr,
            "--steps",
            str(steps),
            "--progress",
            "jsonl",
            "--threads",
            "1",
            "--eval-batches",
            "0",
            "--wait-peers",
            "2",
            "--checkpoint-every-s",
            "0",
        ]
        if self.fixed:
            args.append("--fixed-deadlines")
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=err.open("w"),
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env},
        )
        p = Proc(name, proc, err)
        threading.Thread(target=_read, args=(p,), daemon=True).start()
        self.procs.append(p)
        return p

    def kill(self, p: Proc) -> None:
        for pid in descendants(p.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.proc.kill()
        p.proc.wait(30)

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                self.kill(p)
            else:  # a network process may outlive its trainer
                for pid in descendants(p.proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        if self.boot is not None and self.boot.poll() is None:
            self.boot.kill()
            self.boot.wait(30)

    def measure(self) -> dict[str, Any]:
        args = self.args
        addr = self.start_bootstrap()
        survivors = [self.start_node(f"n{i}", addr, args.steps, {}) for i in range(2)]
        spec = f"stop:{self.point}:0:{args.slot}:3"  # a round the survivors are in
        victim = self.start_node("victim", addr, 100_000, {"ATOLL_FAULT": spec})

        def froze() -> re.Match[str] | None:
            if victim.proc.poll() is not None:
                raise RuntimeError(f"the victim exited before freezing: see {victim.err}")
            return FROZE.search(victim.text())

        found = _wait(froze, args.max_wait_s, "the victim's freeze")
        slot = int(found.group(1))
        froze_at = next(
            s for line in victim.text().splitlines() if FROZE.search(line) and (s := _stamp(line))
        )
        log.info("%s fixed=%s: the victim froze at slot %d", self.point, self.fixed, slot)
        _wait(
            lambda: all(
                p.proc.poll() is not None or p.progress.get("step", 0) >= H * (slot + args.after)
                for p in survivors
            ),
            args.max_wait_s,
            "the survivors passing the frozen slot",
        )
        self.kill(victim)
        for p in survivors:
            code = p.proc.wait(args.max_wait_s)
            if code != 0 or p.summary is None:
                raise RuntimeError(f"{p.name} exited {code}: see {p.err}")
        failed, nexts, deadlines, applied = [], [], [], []
        for p in survivors:
            assert p.summary is not None
            secs = [
                s
                for f, v, status, s, _ in p.summary["info"]["outcomes"]
                if (f, v) == (0, slot) and status == "failed"
            ]
            failed += secs
            applied.append(p.summary["rounds_applied"])
            lines = p.text().splitlines()
            later = [s for line in lines if ": applied;" in line and (s := _stamp(line))]
            later = [s for s in later if s > froze_at]
            if secs and later:
                nexts.append(min(later) - froze_at)
            deadlines += [(float(a), float(b)) for a, b in RAN_OUT.findall(p.text())]
        return {
            "point": self.point,
            "deadlines": "fixed" if self.fixed else "measured",
            "slot": slot,
            "failed_sync_s": failed,
            "to_next_applied_s": nexts,
            "ran_out_at": deadlines,
            "rounds_applied": applied,
            "mean_failed_sync_s": statistics.fmean(failed) if failed else None,
            "mean_to_next_applied_s": statistics.fmean(nexts) if nexts else None,
        }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--quick", action="store_true", help="parts_sent only, shorter timeouts")
    ap.add_argument("--points", default="start,parts_sent")
    ap.add_argument("--slot", type=int, default=6, help="freeze at fragment 0's slot >= this")
    ap.add_argument("--after", type=int, default=2, help="slots the survivors pass, then kill")
    ap.add_argument("--steps", type=int, default=110, help="each survivor's steps")
    ap.add_argument("--part-s", type=float, default=20.0)
    ap.add_argument("--round-s", type=float, default=40.0)
    ap.add_argument("--max-wait-s", type=float, default=420.0)
    ap.add_argument("--modes", default="measured,fixed", help="which deadlines to run")
    ap.add_argument("--debug", action="store_true", help="the nodes log at debug level")
    ap.add_argument("--workdir", type=Path, help="keep the logs here (default: a temp folder)")
    args = ap.parse_args()
    if args.quick:
        args.points = "parts_sent"
        args.part_s, args.round_s = 12.0, 24.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    points = [p for p in args.points.split(",") if p]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="atoll-deadlines-"))
    cases: list[dict[str, Any]] = []
    failed = 0
    for point in points:
        for fixed in [m == "fixed" for m in args.modes.split(",") if m]:
            case = Case(args, work / f"{point}-{'fixed' if fixed else 'measured'}", point, fixed)
            try:
                cases.append(case.measure())
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log.error("case %s fixed=%s failed: %s (logs in %s)", point, fixed, e, case.folder)
                failed += 1
            finally:
                case.close()
    compare = {}
    for point in points:
        by = {c["deadlines"]: c for c in cases if c["point"] == point}
        if len(by) == 2:
            compare[point] = {
                "failed_sync_fixed_over_measured": _ratio(
                    by["fixed"]["mean_failed_sync_s"], by["measured"]["mean_failed_sync_s"]
                ),
                "to_next_applied_fixed_over_measured": _ratio(
                    by["fixed"]["mean_to_next_applied_s"], by["measured"]["mean_to_next_applied_s"]
                ),
            }
    report = {
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "part_s": args.part_s,
        "round_s": args.round_s,
        "cases": cases,
        "compare": compare,
        "failed_cases": failed,
    }
    _print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


def _print(report: dict[str, Any], out: IO[str] = sys.stdout) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(
        f"{'point':11} {'deadlines':9} {'slot':>4} {'failed sync s':>13} "
        f"{'to next applied s':>17} {'applied':>9}",
        file=out,
    )
    for c in report["cases"]:
        print(
            f"{c['point']:11} {c['deadlines']:9} {c['slot']:>4} {f(c['mean_failed_sync_s']):>13} "
            f"{f(c['mean_to_next_applied_s']):>17} {c['rounds_applied']!s:>9}",
            file=out,
        )
    for point, r in report["compare"].items():
        print(
            f"{point}: fixed / measured = {f(r['failed_sync_fixed_over_measured'])}x (failed "
            f"sync), {f(r['to_next_applied_fixed_over_measured'])}x (to the next applied round)",
            file=out,
        )


if __name__ == "__main__":
    sys.exit(main())
