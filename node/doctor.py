"""``atoll doctor``: what a volunteer checks before joining a swarm, one line per check.

Each check gives a verdict (``ok``, ``warn`` or ``fail``), what it found and, when not
ok, what to do:

- torch: installed, its version, and the device a node would train on;
- disk: free space where checkpoints go;
- port: the listen address can be bound (another program may hold the port);
- reachability: peers (the ``--join`` addresses) dial this node back at its listen port
  on a fresh connection (:mod:`~atoll.node.net.dialback`); behind a NAT or a firewall
  they cannot;
- clock: the skew against those peers' clocks (records expire on wall time).

The last two need at least one ``--join`` address; without one they are skipped with a
line saying so. Exit status 1 when a check failed, else 0.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from atoll.protocol.errors import AtollError
from atoll.protocol.reachability import DialBackReply, verdict

__all__ = ["Check", "run_doctor"]

MIN_FREE_GB = 5.0
"""below this much free disk for checkpoints: a warning"""
MAX_SKEW_S = 5.0
"""a clock further off than this from the peers': a warning"""


@dataclass(frozen=True, slots=True)
class Check:
    """One check's verdict."""

    name: str
    verdict: str
    """``ok``, ``warn``, ``fail`` or ``skip``"""
    detail: str

    def line(self) -> str:
        return f"{self.verdict:<4}  {self.name}: {self.detail}"


def check_torch() -> Check:
    try:
        import torch
    except ImportError as e:
        return Check("torch", "fail", f"not installed ({e}): `make venv` installs it")
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)})"
        return Check("torch", "ok", f"torch {torch.__version__}, trains on {device}")
    return Check(
        "torch",
        "warn",
        f"torch {torch.__version__}, no GPU: trains on the CPU (slow; a CUDA build of torch"
        " and a GPU driver make it a GPU node)",
    )


def check_disk(folder: Path) -> Check:
    where = folder.expanduser()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free_gb = shutil.disk_usage(probe).free / 1e9
    if free_gb < MIN_FREE_GB:
        return Check(
            "disk",
            "warn",
            f"{free_gb:.1f} GB free at {where} (checkpoints want at least {MIN_FREE_GB:.0f} GB):"
            " free some space or pass another --checkpoint-dir",
        )
    return Check("disk", "ok", f"{free_gb:.1f} GB free at {where}")


async def _network(
    listen: str, joins: Sequence[str], timeout_s: float
) -> tuple[Check, list[Check]]:
    from atoll.node.net.host import HostConfig, open_libp2p_host
    from atoll.security.identity import generate

    config = HostConfig(listen=(listen,), dial_timeout_s=timeout_s)
    try:
        async with open_libp2p_host(generate(), config) as host:
            return await _ask(host, listen, joins, timeout_s)
    except (AtollError, OSError) as e:  # the per-peer questions catch their own errors
        return Check("port", "fail", f"cannot listen on {listen}: {e}"), []


async def _ask(
    host: Any, listen: str, joins: Sequence[str], timeout_s: float
) -> tuple[Check, list[Check]]:
    """The port, reachability and clock checks, once ``host`` listens."""
    from atoll.node.net.dialback import ask_dialback, listen_ports

    ports = listen_ports(str(a) for a in host.get_addrs())
    port = Check("port", "ok", f"listening on {listen} (port {', '.join(map(str, ports))})")
    if not joins:
        skipped = "no --join address to ask"
        return port, [Check("reachability", "skip", skipped), Check("clock", "skip", skipped)]
    replies: list[DialBackReply] = []
    arrived: list[float] = []
    problems: list[str] = []
    for addr in joins:
        try:
            replies.append(await ask_dialback(host, addr, ports, timeout_s=timeout_s))
            arrived.append(time.time())
        except AtollError as e:
            problems.append(str(e))
    found = verdict(replies, local_wall_s=arrived)
    extra = f" ({'; '.join(problems)})" if problems else ""
    level = {"public": "ok", "private": "warn"}.get(found.reach, "fail")
    reach = Check("reachability", level, found.line() + extra)
    if found.skew_s is None:
        clock = Check("clock", "skip", "no peer answered")
    elif abs(found.skew_s) > MAX_SKEW_S:
        clock = Check(
            "clock",
            "warn",
            f"{found.skew_s:+.1f} s off the peers' clocks: records expire on wall time;"
            " turn on time synchronisation (NTP)",
        )
    else:
        clock = Check("clock", "ok", f"{found.skew_s:+.2f} s from the peers' clocks")
    return port, [reach, clock]


def run_doctor(
    *,
    listen: str,
    joins: Sequence[str],
    checkpoint_dir: Path,
    timeout_s: float = 10.0,
) -> list[Check]:
    """Every check, in order."""
    checks = [check_torch(), check_disk(checkpoint_dir)]
    port, rest = trio.run(_network, listen, joins, timeout_s)
    checks.append(port)
    checks.extend(rest)
    return checks
