#!/usr/bin/env python3
"""Multi-source state copies: how fast a joiner copies a fragment's state from 1 and 3 donors.

Each donor is an OS process of its own with one :func:`~atoll.node.net.host.open_host`
and a :class:`~atoll.node.net.rounds.Mailbox` that answers index and piece requests
(:func:`~atoll.node.net.rounds.serve_pieces`) from the same seeded state of ``--mb`` MB.
The joiner, another process, dials them and runs
:func:`~atoll.node.net.rounds.fetch_pieces` (the :class:`~atoll.protocol.statefetch.
StateFetch` planner, as a node's rebase does), then checks that the copy's digest is the
state's. The time is the copy alone (connections are set up first).

    python bench/statesync.py --mb 32 --json runs/statesync.json
    python bench/statesync.py --mb 32 --wanlab /work/shared/tools/wanlab/wanlab \\
        --rate 100mbit --delay 10ms --json runs/statesync-wan.json

On loopback every process shares the machine's cores, so the figure is CPU-bound (Noise,
hashing). With ``--wanlab`` (root only) each process runs in a namespace of its own
(``wanlab up``), the joiner's link limited to ``--rate`` both ways and the donors' links
to ``--donor-rate`` (default: the same rate), every link ``--delay`` one way; the
report gives the copy's rate as a share of the joiner's link rate. ``--die-after K``
makes the first donor SIGKILL itself once it has served K pieces, at the request that
would take it past K (so pieces asked of it are left unserved, however quickly the copy
runs, and the copy must still end with the right state). ``--serve-mbps R`` makes each
donor wait, before each run of pieces, as long as a link of R MB/s would take to carry
it: a crude link rate without namespaces. The workers speak JSON lines
with the parent; their logs go to files in a temporary folder, named when something
fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

log = logging.getLogger("bench.statesync")

RUN_ID = "5e" * 32
ROOT = Path(__file__).resolve().parent.parent


def _state(mb: float, seed: int) -> Any:
    from atoll.protocol.statesync import FragmentState

    numel = max(1, int(mb * 1e6) // 8)
    rng = np.random.default_rng(seed)
    return FragmentState(
        7,
        3,
        1000,
        rng.standard_normal(numel, dtype=np.float32),
        rng.standard_normal(numel, dtype=np.float32),
    )


def _emit(out: IO[str], **msg: Any) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def _config(listen: str) -> Any:
    from atoll.node.net.host import HostConfig, exclusive_listen_addr

    return HostConfig(
        listen=(exclusive_listen_addr(listen),), dial_timeout_s=30.0, send_timeout_s=60.0
    )


async def _donor(args: argparse.Namespace, out: IO[str]) -> None:
    import trio

    from atoll.node.net.heap import keep_freed_memory
    from atoll.node.net.host import open_host
    from atoll.node.net.rounds import Mailbox, serve_pieces
    from atoll.protocol import statepieces as sp
    from atoll.protocol import statesync as ss
    from atoll.security.identity import generate

    keep_freed_memory()
    source = sp.PieceSource.of(_state(args.mb, args.seed))
    served = [0]

    async def serve(sender: str, msg: object) -> None:
        if isinstance(msg, sp.StateIndexRequest | sp.StatePieceRequest):
            if isinstance(msg, sp.StatePieceRequest):
                if args.die_after and served[0] + msg.count > args.die_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # with this request unserved
                served[0] += msg.count
                if args.serve_mbps > 0:  # a donor's link of that rate, roughly
                    await trio.sleep(msg.count * ss.PIECE_BYTES / (args.serve_mbps * 1e6))
            await serve_pieces(host, sender, msg, source, step=1000 + args.index)

    async with (
        open_host(generate(), RUN_ID, _config(args.listen)) as host,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(Mailbox(host, on_request=serve).run)
        addr = next(a for a in host.addrs if "/tcp/" in a)
        _emit(out, event="up", addr=addr, digest=source.digest)
        await trio.lowlevel.FdStream(os.dup(0)).receive_some(1)  # until stdin closes
        nursery.cancel_scope.cancel()


async def _joiner(args: argparse.Namespace, out: IO[str]) -> None:
    import trio

    from atoll.node.net.host import open_host
    from atoll.node.net.rounds import Mailbox, fetch_pieces
    from atoll.protocol import statefetch as sf
    from atoll.protocol import statesync as ss
    from atoll.security.identity import generate

    state = _state(args.mb, args.seed)
    target = (state.version, state.digest())
    async with (
        open_host(generate(), RUN_ID, _config(args.listen)) as host,
        trio.open_nursery() as nursery,
    ):
        mailbox = Mailbox(host)
        nursery.start_soon(mailbox.run)
        for addr in args.donor:
            await host.connect(addr)
        donors = [a.rsplit("/p2p/", 1)[1] for a in args.donor]
        fetch = sf.StateFetch(
            me=host.peer_id,
            run_id=RUN_ID,
            fragment=0,
            target=target,
            numel=state.global_params.size,
            donors=donors,
            timeout_s=5.0,
        )
        t0 = time.perf_counter()
        outcome = await fetch_pieces(host, mailbox, fetch, timeout_s=600.0)
        seconds = time.perf_counter() - t0
        ok = isinstance(outcome, sf.Finished) and outcome.state.digest() == target[1]
        _emit(
            out,
            event="done",
            ok=ok,
            seconds=seconds,
            bytes=ss.state_bytes(state.global_params.size),
            donors_used=len(outcome.donors) if isinstance(outcome, sf.Finished) else 0,
            dropped=[[d.peer[-6:], d.hostile, d.reason] for d in fetch.dropped],
            reason="" if ok else getattr(outcome, "reason", "wrong digest"),
        )
        nursery.cancel_scope.cancel()


def worker_main(args: argparse.Namespace) -> int:
    import trio

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    logging.basicConfig(
        level=logging.INFO if args.role == "joiner" else logging.WARNING,
        stream=sys.stderr,
        format=f"%(asctime)s {args.role}{args.index} %(name)s %(levelname)s %(message)s",
    )
    trio.run(_donor if args.role == "donor" else _joiner, args, out)
    return 0


# --------------------------------------------------------------------------------------
# the parent
# --------------------------------------------------------------------------------------
class _Lab:
    """Processes on loopback, or each in a wanlab namespace of its own."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []

    def host_of(self, i: int) -> str:
        if not self.args.wanlab:
            return "127.0.0.1"
        return subprocess.check_output([self.args.wanlab, "ip", str(i)], text=True).strip()

    def start(self, i: int, role: str, extra: list[str]) -> subprocess.Popen[str]:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--role",
            role,
            "--index",
            str(i),
            "--mb",
            str(self.args.mb),
            "--serve-mbps",
            str(self.args.serve_mbps),
            "--listen",
            f"/ip4/{self.host_of(i)}/tcp/0",
            *extra,
        ]
        if self.args.wanlab:
            cmd = [self.args.wanlab, "exec", str(i), *cmd]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(self.tmp / f"{role}{i}.err").open("w"),
            text=True,
            env=dict(os.environ),
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None and p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()


def _line(proc: subprocess.Popen[str], what: str, tmp: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        logs = "\n".join(f"{f.name}: {f.read_text()[-2000:]}" for f in sorted(tmp.glob("*.err")))
        raise SystemExit(f"no {what} line; logs:\n{logs}")
    msg: dict[str, Any] = json.loads(line)
    return msg


def _rate_bytes_per_s(rate: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise SystemExit(f"--rate like 100mbit, not {rate!r}")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return float(m.group(1)) * scale / 8


def run_case(args: argparse.Namespace, donors: int, tmp: Path) -> dict[str, Any]:
    lab = _Lab(args, tmp)
    try:
        addrs = []
        for i in range(1, donors + 1):
            extra = ["--die-after", str(args.die_after)] if i == 1 and args.die_after else []
            proc = lab.start(i, "donor", extra)
            addrs.append(_line(proc, "donor up", tmp)["addr"])
        joiner = lab.start(0, "joiner", [x for a in addrs for x in ("--donor", a)])
        done = _line(joiner, "joiner done", tmp)
    finally:
        lab.close()
    mb_s = done["bytes"] / done["seconds"] / 1e6
    result = {"donors": donors, **done, "MB_per_s": round(mb_s, 1)}
    if args.wanlab:
        result["link_share"] = round(
            done["bytes"] / done["seconds"] / _rate_bytes_per_s(args.rate), 3
        )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mb", type=float, default=32.0, help="state size, MB (8 bytes a value)")
    ap.add_argument("--donors", default="1,3", help="donor counts to measure")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument(
        "--serve-mbps",
        type=float,
        default=0.0,
        help="each donor waits as a link of this many MB/s would before each run of pieces",
    )
    ap.add_argument("--wanlab", help="path of the wanlab tool (root only)")
    ap.add_argument("--rate", default="100mbit", help="the joiner's link rate (wanlab)")
    ap.add_argument("--donor-rate", default="", help="each donor's link rate (wanlab)")
    ap.add_argument("--delay", default="10ms", help="one-way delay of every link (wanlab)")
    ap.add_argument(
        "--die-after", type=int, default=0, help="donor 1 dies at the request past K pieces"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help=argparse.SUPPRESS)
    ap.add_argument("--donor", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    counts = [int(x) for x in args.donors.split(",")]
    if args.wanlab:
        wl = args.wanlab
        subprocess.run([wl, "down"], check=False, capture_output=True)
        n = 1 + max(counts)
        subprocess.run(
            [wl, "up", str(n), "--rate", args.donor_rate or args.rate, "--delay", args.delay],
            check=True,
        )
        subprocess.run([wl, "shape", "0", "--up", args.rate, "--down", args.rate], check=True)
    report: dict[str, Any] = {
        "mb": args.mb,
        "wanlab": bool(args.wanlab),
        "rate": args.rate if args.wanlab else None,
        "donor_rate": (args.donor_rate or args.rate) if args.wanlab else None,
        "delay": args.delay if args.wanlab else None,
        "die_after": args.die_after,
        "command": " ".join(sys.argv),
        "cases": [],
    }
    try:
        with tempfile.TemporaryDirectory(prefix="statesync-") as tmp:
            for donors in counts:
                for _ in range(args.repeat):
                    case = run_case(args, donors, Path(tmp))
                    report["cases"].append(case)
                    print(json.dumps(case), flush=True)
                    if not case["ok"]:
                        print(f"copy failed: {case['reason']}", file=sys.stderr)
                        return 1
    finally:
        if args.wanlab:
            subprocess.run([args.wanlab, "down"], check=False, capture_output=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
