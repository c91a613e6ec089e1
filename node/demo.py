"""``atoll demo``: a whole swarm on this machine, watched from one terminal.

Starts ``atoll bootstrap`` and N ``atoll node`` processes on 127.0.0.1 (each with its own
identity in a temporary folder), all training one run from a manifest written here (the
default tiny model on the built-in corpus, Streaming DiLoCo with 4-bit E3M0 syncs). While
they train it prints a live table (step, loss, tokens/s, peers seen, last sync per
fragment, bytes up); at the end a summary: loss per node, bytes each peer sent, and what
data-parallel training would have sent for the same steps. ``--json FILE`` writes it.

Every child is a real process speaking over real sockets; the demo only reads their JSON
progress lines (``atoll node --progress jsonl``); each node also writes its full summary
to ``node<i>.json`` in the demo's folder. A network lab (``DemoConfig.lab``, or wanlab) can
host the processes, each in a namespace of its own. Ctrl+C stops the nodes cleanly (SIGINT),
then the bootstrap; a node that does not stop within its bound is killed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, TextIO

from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import OuterLoop

__all__ = ["DemoConfig", "Lab", "manifest_text", "run_demo"]

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 60.0


class Lab(Protocol):
    """A network lab hosting the demo's processes (e.g. :class:`atoll.node.netlab.NetLab`)."""

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a process inside the lab's node ``i``."""
        ...

    def ip(self, i: int) -> str:
        """The IPv4 address of the lab's node ``i``."""
        ...


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs."""

    nodes: int = 4
    steps: int = 300
    preset: str = "tiny"
    H: int = 50
    tau: int = 5
    codec: str = "e3m0"
    batch_size: int = 8
    threads: int = 1
    """torch threads per node (the nodes share this machine's cores)"""
    refresh_s: float = 3.0
    workdir: str | None = None
    """keep the nodes' files (identities, logs, manifest) here instead of a temp folder"""
    wanlab: str | None = None
    """path of the wanlab tool: run node i (and the bootstrap, in node 0) inside wanlab's
    namespace i, on its address (the lab must be up with at least ``nodes`` nodes)"""
    timeouts_scale: float = 1.0
    """multiply the manifest's timeouts (slow links)"""
    lab: Lab | None = None
    """a network lab with ``nodes + 1`` nodes: node i runs in the lab's node i, the
    bootstrap in node ``nodes`` (a fault of node 0 leaves the bootstrap alone)"""
    slowdown: Mapping[int, float] = field(default_factory=dict)
    """node index -> how many times slower its trainer runs (``ATOLL_SLOWDOWN``: after
    each step it sleeps the step's compute time times the factor less one); others: 1"""

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ConfigError("the demo needs at least 2 nodes")
        if self.lab is not None and self.wanlab:
            raise ConfigError("the demo runs in one lab: wanlab or lab, not both")
        if self.steps < self.H:
            raise ConfigError(f"steps ({self.steps}) must be at least H ({self.H})")
        OuterLoop(H=self.H, tau=self.tau, codec=self.codec)  # checked where it is declared
        for i, factor in self.slowdown.items():
            if not 0 <= i < self.nodes or not factor >= 1:
                raise ConfigError(
                    f"slowdown {i}: {factor}: a node index below {self.nodes} and a factor >= 1"
                )


def manifest_text(cfg: DemoConfig) -> str:
    """The run manifest every demo node trains (TOML)."""
    return f"""# written by atoll demo
name = "atoll-demo"
model = "{cfg.preset}"
batch_size = {cfg.batch_size}
lr = 3e-3
warmup = {max(10, cfg.steps // 20)}
total_steps = {cfg.steps}
H = {cfg.H}
tau = {cfg.tau}
alpha = 0.5
codec = "{cfg.codec}"

[group]
min_quorum = 2
max_size = {max(2, cfg.nodes)}
grace_s = 3.0

[timeouts]
matchmaking_s = {15.0 * cfg.timeouts_scale}
part_s = {20.0 * cfg.timeouts_scale}
round_s = {40.0 * cfg.timeouts_scale}
apply_wait_s = 5.0
"""


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[str]
    log: IO[str]
    progress: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None


def _python() -> list[str]:
    return [sys.executable, "-m", "atoll.node.cli"]


def _read_lines(child: _Child) -> None:
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "progress" in msg:
            child.progress = msg["progress"]
        elif "summary" in msg:
            child.summary = msg["summary"]


def _table(children: list[_Child]) -> str:
    rows = [
        f"{'node':<7}{'step':>11}{'loss':>9}{'ktok/s':>8}{'peers':>6}{'up MB':>9}"
        f"{'wait s':>8}  syncs (fragment:version xgroup)"
    ]
    for c in children:
        p = c.progress
        if not p:
            rows.append(f"{c.name:<7}{'starting':>11}")
            continue
        syncs = " ".join(f"{k}:{v}" for k, v in sorted(p.get("last_sync", {}).items())) or "-"
        rows.append(
            f"{c.name:<7}{p['step']:>6}/{p['end']:<4}{p['loss']:>9.4f}"
            f"{p['tokens_per_s'] / 1e3:>8.1f}{p['peers']:>6}{p['bytes_up'] / 1e6:>9.2f}"
            f"{p['net_wait_s']:>8.1f}  {syncs}"
        )
    return "\n".join(rows)


def _wrap(cfg: DemoConfig, i: int) -> list[str]:
    """The command prefix that runs a process as node ``i`` (wanlab's namespace i, or the
    lab's node i)."""
    if cfg.lab is not None:
        return cfg.lab.prefix(i)
    return [cfg.wanlab, "exec", str(i)] if cfg.wanlab else []


def _boot_index(cfg: DemoConfig) -> int:
    """The lab node the bootstrap runs in: its own in a lab, node 0's under wanlab."""
    return cfg.nodes if cfg.lab is not None else 0


def _listen(cfg: DemoConfig, i: int) -> str:
    if cfg.lab is not None:
        return f"/ip4/{cfg.lab.ip(i)}/tcp/0"
    if not cfg.wanlab:
        return "/ip4/127.0.0.1/tcp/0"
    ip = subprocess.run(
        [cfg.wanlab, "ip", str(i)], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    return f"/ip4/{ip}/tcp/0"


def start_bootstrap(cfg: DemoConfig, work: Path) -> tuple[subprocess.Popen[str], str]:
    """Start the run's bootstrap peer in ``work`` (its log: ``bootstrap.log``) and wait
    for its address (ConfigError when it does not start in time); the process and its
    first multiaddr."""
    addr_file = work / "bootstrap.addr"
    log = (work / "bootstrap.log").open("w")
    proc = subprocess.Popen(
        [
            *_wrap(cfg, _boot_index(cfg)),
            *_python(),
            "bootstrap",
            "--identity",
            str(work / "bootstrap.key"),
            "--listen",
            _listen(cfg, _boot_index(cfg)),
            "--addr-file",
            str(addr_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if addr_file.exists() and addr_file.read_text().strip():
            return proc, addr_file.read_text().split()[0]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise ConfigError(f"the bootstrap peer did not start; see {work / 'bootstrap.log'}")


def stop_process(proc: subprocess.Popen[str], timeout_s: float) -> None:
    """SIGINT, then a kill after ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("process %d did not stop in %.0f s: killed", proc.pid, timeout_s)
            proc.kill()
            proc.wait(5)


def run_demo(
    cfg: DemoConfig, out: TextIO = sys.stderr, finish: threading.Event | None = None
) -> dict[str, Any]:
    """Run the demo swarm; returns the summary (also what ``--json`` writes).

    ``finish``, once set, asks every node to finish its run at its current step (SIGUSR1:
    the fragments settle and each node reports as at its last step), for a caller that
    ends the run at a time rather than at ``cfg.steps``."""
    tmp = None
    if cfg.workdir:
        work = Path(cfg.workdir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="atoll-demo-")
        work = Path(tmp.name)
    manifest = work / "run.toml"
    manifest.write_text(manifest_text(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONUNBUFFERED": "1"}
    print(
        f"atoll demo: a bootstrap peer and {cfg.nodes} nodes on 127.0.0.1 train the "
        f"'{cfg.preset}' model for {cfg.steps} steps (Streaming DiLoCo, {cfg.codec}, "
        f"H={cfg.H}, tau={cfg.tau}); files in {work}",
        file=out,
        flush=True,
    )
    boot, addr = start_bootstrap(cfg, work)
    children: list[_Child] = []
    interrupted = False
    t0 = time.monotonic()
    try:
        for i in range(cfg.nodes):
            log = (work / f"node{i}.log").open("w")
            proc = subprocess.Popen(
                [
                    *_wrap(cfg, i),
                    *_python(),
                    "-v",
                    "node",
                    "--run",
                    str(manifest),
                    "--join",
                    addr,
                    "--identity",
                    str(work / f"node{i}.key"),
                    "--listen",
                    _listen(cfg, i),
                    "--steps",
                    str(cfg.steps),
                    "--progress",
                    "jsonl",
                    "--threads",
                    str(cfg.threads),
                    "--wait-peers",
                    str(cfg.nodes - 1),
                    "--log-every",
                    str(max(1, cfg.H // 5)),
                    "--json",
                    str(work / f"node{i}.json"),
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**env, "ATOLL_SLOWDOWN": str(cfg.slowdown[i])} if i in cfg.slowdown else env,
            )
            child = _Child(f"node{i}", proc, log)
            threading.Thread(target=_read_lines, args=(child,), daemon=True).start()
            children.append(child)
        asked = False
        while any(c.proc.poll() is None for c in children):
            if finish is None or asked:
                time.sleep(cfg.refresh_s)
            elif finish.wait(cfg.refresh_s):
                asked = True
                for c in children:
                    if c.proc.poll() is None:
                        c.proc.send_signal(signal.SIGUSR1)
                continue
            print(f"\n[{time.monotonic() - t0:6.0f} s]\n{_table(children)}", file=out, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\natoll demo: stopping the nodes...", file=out, flush=True)
    finally:
        for c in children:
            stop_process(c.proc, _STOP_TIMEOUT_S)
        stop_process(boot, 10.0)
        time.sleep(0.2)  # the reader threads take the last lines
        for c in children:
            c.log.close()
    summary = _summary(cfg, children, time.monotonic() - t0, interrupted)
    print(_final(summary), file=out, flush=True)
    if tmp is not None:
        tmp.cleanup()
    return summary


def _summary(
    cfg: DemoConfig, children: list[_Child], wall_s: float, interrupted: bool
) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    for c in children:
        s = c.summary or {}
        nodes.append(
            {
                "name": c.name,
                "exit_code": c.proc.returncode,
                "peer_id": s.get("peer_id"),
                "steps": s.get("steps"),
                "first_loss": s.get("first_loss"),
                "last_loss": s.get("last_loss"),
                "eval_loss": s.get("eval_loss"),
                "bytes_up": s.get("bytes_up"),
                "bytes_down": s.get("bytes_down"),
                "ddp_bytes": s.get("ddp_bytes"),
                "rounds_applied": s.get("rounds_applied"),
                "rounds_failed": s.get("rounds_failed"),
                "rounds_alone": s.get("rounds_alone"),
                "rounds_ahead": s.get("rounds_ahead"),
                "rebases": s.get("rebases"),
                "utilisation": s.get("utilisation"),
                "tokens": s.get("tokens"),
                "wall_s": s.get("wall_s"),
                "compute_s": s.get("compute_s"),
                "tokens_per_s": (s["tokens"] / s["wall_s"]) if s.get("wall_s") else None,
                "net_wait_s": s.get("net_wait_s"),
                "global_digest": s.get("global_digest"),
            }
        )
    done = [n for n in nodes if n["bytes_up"] is not None]
    mean_up = sum(n["bytes_up"] for n in done) / len(done) if done else None
    ddp = max((n["ddp_bytes"] or 0 for n in done), default=0)
    return {
        "config": {**cfg.__dict__, "lab": repr(cfg.lab) if cfg.lab is not None else None},
        "wall_s": wall_s,
        "interrupted": interrupted,
        "nodes": nodes,
        "mean_bytes_up_per_peer": mean_up,
        "ddp_bytes_per_peer": ddp,
        "bytes_ratio": (ddp / mean_up) if mean_up else None,
        "ok": all(n["exit_code"] == 0 for n in nodes) and len(done) == len(nodes),
    }


def _final(s: dict[str, Any]) -> str:
    lines = ["", "atoll demo: summary"]
    for n in s["nodes"]:
        if n["last_loss"] is None:
            lines.append(f"  {n['name']}: no summary (exit code {n['exit_code']})")
            continue
        ev = f", eval {n['eval_loss']:.4f}" if n["eval_loss"] is not None else ""
        lines.append(
            f"  {n['name']}: loss {n['first_loss']:.4f} -> {n['last_loss']:.4f}{ev}; "
            f"rounds {n['rounds_applied']} applied, {n['rounds_failed']} failed, "
            f"{n['rounds_alone']} alone; sent {n['bytes_up'] / 1e6:.2f} MB"
        )
    if s["mean_bytes_up_per_peer"]:
        lines.append(
            f"  bytes per peer: {s['mean_bytes_up_per_peer'] / 1e6:.2f} MB; data-parallel "
            f"would have sent {s['ddp_bytes_per_peer'] / 1e6:.1f} MB "
            f"({s['bytes_ratio']:.0f}x more)"
        )
    return "\n".join(lines)
