#!/usr/bin/env python3
"""All-reduce throughput of atoll's network rounds, optionally against hivemind 1.1.12.

N peers, each an OS process of its own on 127.0.0.1, average a float32 vector of SIZE MB
(different random data per peer, equal weights) R times. The atoll side runs one
:func:`~atoll.node.net.host.open_host` per process, a :class:`~atoll.node.net.rounds.Mailbox`,
a full mesh of connections and :func:`~atoll.node.net.rounds.run_allreduce` per round
(members: the sorted peer ids; ``RoundKey(run_id, 0, r)``). The parent starts every round
at once (a barrier), so a round's time is that of the round alone: the slowest peer's wall
time from encoding its vector to holding the decoded average.

    python bench/allreduce.py --quick                                   # 3 peers, 1 MB, 2 rounds
    python bench/allreduce.py --peers 4 --mb 100 --codec e3m0 --rounds 3 --json runs/e3m0.json
    python bench/allreduce.py --peers 4 --mb 100 --rounds 3 --compare-hivemind --json fp32.json

``--compare-hivemind`` averages the same vectors (same seeds) with hivemind's
``DecentralizedAverager`` (a hivemind DHT among the N processes, ``target_group_size=N``,
no compression: fp32 whatever ``--codec`` says), in the Python of ``--hivemind-python``
(default: ``.venv-hivemind`` beside this repository when present; hivemind 1.1.12 wants
protobuf 7, while libp2p here runs on protobuf 6; never install it into ``.venv``)::

    python3 -m venv .venv-hivemind
    .venv-hivemind/bin/pip install torch==2.13.0 hivemind==1.1.12

Matchmaking happens before the barrier and is not timed; the timed part is hivemind's
all-reduce, from the trigger to the result.

The JSON report holds, per round:

- ``round_s``: the slowest peer's wall time (``peer_round_s``: every peer's);
- ``encode_s`` (atoll only): the slowest peer's encoding of its vector, part of the round;
- ``bytes_sent_per_peer``: atoll: bytes written to atoll streams, frame headers
  included, mean over peers; hivemind, which has no such counter: its TCP bytes;
- ``tcp_bytes_sent_per_peer``: TCP payload bytes the peer's processes sent, from ``ss``
  (Noise, yamux and protobuf overheads included), mean over peers;
- ``cpu_s``: CPU seconds of all peer processes, children (hivemind's p2pd) included;
- ``other_cpu_s``: CPU seconds the rest of the machine used meanwhile: other work skews
  the numbers, keep it near 0;
- ``max_abs_error_per_round``: the largest ``|result - true mean|`` over the peers, the
  true mean computed in float64 by the parent from the same seeds (``max_abs_error``:
  over all rounds).

``--verify-owners`` measures instead what verified chunk owners
(:attr:`~atoll.protocol.allreduce.RoundSpec.verify_owners`) cost against the plain round,
side by side in one run, for each group size of ``--verify-peers`` (default 4 and 8). The
members run in this one process (their round machines driven by a FIFO queue, every
message encoded with the wire codec), so the figures are the protocol's own, without a
network: per round and mode, ``wire_bytes_sent_per_member`` (frames, headers included,
mean over members), ``payload_bytes_sent_per_member``, ``messages_per_member``,
``busy_s_max`` (the largest time one member spent in its machine: slicing, hashing,
decoding, reducing, verifying, encoding) and ``wall_s`` (the whole round, every member's
work one after another on one thread)::

    python bench/allreduce.py --verify-owners --mb 16 --rounds 3 --codec e3m0 --json v.json

The workers speak JSON lines with the parent on their stdin and stdout; their logs go to
files in a temporary folder, named when something fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import re
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

import numpy as np
import numpy.typing as npt

log = logging.getLogger("bench.allreduce")

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
HIVEMIND_VENV_PYTHON = REPO / ".venv-hivemind" / "bin" / "python"
CODECS = ("fp32", "bf16", "int8", "e3m0", "e3m0-sr")  # atoll.protocol.codecs.CODEC_NAMES
START_TIMEOUT_S = 120.0  # imports and a host or DHT start on a busy 2-core machine
QUIET_ENV = {"PYTHONUNBUFFERED": "1", "HIVEMIND_LOGLEVEL": "ERROR", "GOLOG_LOG_LEVEL": "error"}

F32Array = npt.NDArray[np.float32]
Msg = dict[str, Any]


class BenchError(Exception):
    """The benchmark could not run or a round failed; the message says why."""


# --------------------------------------------------------------------------------------
# data, shared by the parent and both kinds of worker
# --------------------------------------------------------------------------------------
def numel_of(mb: float) -> int:
    """float32 values in ``mb`` MiB."""
    return int(mb * 2**20 / 4)


def peer_data(seed: int, index: int, numel: int) -> F32Array:
    """Peer ``index``'s vector: standard normal float32, from ``(seed, index)``."""
    return np.random.default_rng([seed, index]).standard_normal(numel, dtype=np.float32)


def true_mean(seed: int, peers: int, numel: int) -> F32Array:
    """The equal-weight mean of every peer's vector, summed in float64, as float32."""
    acc = np.zeros(numel, np.float64)
    for i in range(peers):
        acc += peer_data(seed, i, numel)
    acc /= peers
    return acc.astype(np.float32)


# --------------------------------------------------------------------------------------
# measuring a process tree (Linux /proc and ss)
# --------------------------------------------------------------------------------------
def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants (from /proc/<pid>/task/<tid>/children)."""
    found: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.append(pid)
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError):
                stack.extend(int(c) for c in (task / "children").read_text().split())
    return found


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root`` and its live descendants so far."""
    if not Path("/proc/self/stat").exists():
        return time.process_time()
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in process_tree(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / ticks


_SS_PID = re.compile(r"pid=(\d+)")
_SS_SENT = re.compile(r"\bbytes_sent:(\d+)")


def tcp_bytes_sent(pids: Sequence[int]) -> int | None:
    """TCP payload bytes sent so far on the established sockets ``pids`` hold (``ss``);
    None where ``ss`` is missing."""
    if shutil.which("ss") is None:
        return None
    try:
        out = subprocess.run(
            ["ss", "-tinpH", "state", "established"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    wanted = {str(p) for p in pids}
    total = 0
    owned = False
    for line in out.splitlines():
        if line and not line[0].isspace():  # a socket: addresses and owners
            owned = bool(wanted.intersection(_SS_PID.findall(line)))
        elif owned:  # its TCP info
            m = _SS_SENT.search(line)
            if m:
                total += int(m.group(1))
            owned = False
    return total


def machine_cpu_s() -> float | None:
    """Busy CPU seconds of the whole machine so far (/proc/stat), None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Meter:
    """CPU seconds and TCP bytes of this worker's process tree, between two points."""

    def __init__(self) -> None:
        self._cpu = 0.0
        self._tcp: int | None = 0

    def start(self) -> None:
        """Take the starting readings."""
        self._tcp = tcp_bytes_sent(process_tree(os.getpid()))
        self._cpu = tree_cpu_s(os.getpid())

    def stop(self) -> tuple[float, int | None]:
        """CPU seconds and TCP bytes sent since :meth:`start`."""
        cpu = tree_cpu_s(os.getpid()) - self._cpu
        tcp = tcp_bytes_sent(process_tree(os.getpid()))
        sent = None if tcp is None or self._tcp is None else tcp - self._tcp
        return cpu, sent


# --------------------------------------------------------------------------------------
# workers (this file run with --worker): JSON lines on stdin and the original stdout
# --------------------------------------------------------------------------------------
def emit(out: IO[str], **msg: Any) -> None:
    """Send one message to the parent."""
    out.write(json.dumps(msg) + "\n")
    out.flush()


def worker_main(args: argparse.Namespace) -> int:
    """Run one peer; every failure is reported to the parent as an ``error`` message."""
    # libraries that print (hivemind's p2pd, say) must not garble the protocol
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"%(asctime)s peer{args.index} %(name)s %(levelname)s %(message)s",
    )
    try:
        if args.worker == "atoll":
            import trio

            trio.run(_atoll_peer, args, proto)
        else:
            _hivemind_peer(args, proto)
    except BaseException as e:
        log.exception("peer %d failed", args.index)
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        emit(proto, event="error", error=f"peer {args.index}: {text}")
        return 1
    return 0


class _Lines:
    """JSON lines from a trio receive stream (the worker's stdin)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._buf = b""

    async def next(self) -> Msg | None:
        while b"\n" not in self._buf:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: Msg = json.loads(line)
        return msg


async def _atoll_peer(args: argparse.Namespace, proto: IO[str]) -> None:
    """One atoll peer: host, mailbox, full mesh, then the rounds the parent starts."""
    import trio

    from atoll.node.net.heap import keep_freed_memory
    from atoll.node.net.host import HostConfig, open_host
    from atoll.node.net.rounds import Mailbox, run_allreduce
    from atoll.protocol.allreduce import Done, RoundKey, RoundSpec
    from atoll.protocol.codecs import make_codec
    from atoll.protocol.messages import MAX_FRAME_BYTES
    from atoll.security.identity import generate

    keep_freed_memory()  # as atoll's network process does
    numel = numel_of(args.mb)
    data = peer_data(args.seed, args.index, numel)
    codec = make_codec(args.codec)
    frame_bytes = min(0xFFFFFFFF, max(MAX_FRAME_BYTES, codec.encoded_size(numel) + (1 << 16)))
    listen = "/ip4/127.0.0.1/tcp/0"
    try:  # py-libp2p binds with SO_REUSEPORT: port 0 may land on a port another node holds
        from atoll.node.net.host import exclusive_listen_addr

        listen = exclusive_listen_addr(listen)
    except ImportError:
        pass
    config = HostConfig(
        listen=(listen,),
        dial_timeout_s=60.0,
        hello_timeout_s=60.0,
        send_timeout_s=args.timeout,
        max_frame_bytes=frame_bytes,
    )
    meter = Meter()
    async with open_host(generate(), args.run_id, config) as host, trio.open_nursery() as nursery:
        mailbox = Mailbox(host)
        nursery.start_soon(mailbox.run)
        lines = _Lines(trio.lowlevel.FdStream(os.dup(0)))
        addr = next((a for a in host.addrs if "/ip4/127.0.0.1/" in a), host.addrs[0])
        emit(proto, event="up", peer=host.peer_id, addr=addr)

        cmd = await lines.next()
        if cmd is None or cmd.get("cmd") != "peers":
            raise BenchError(f"expected the peers, got {cmd!r}")
        peers = [a.rsplit("/p2p/", 1)[1] for a in cmd["addrs"]]
        members = tuple(sorted(peers))
        mean = np.load(cmd["mean"], mmap_mode="r")
        with trio.move_on_after(args.timeout) as dialing:
            async with trio.open_nursery() as dials:
                for other in cmd["addrs"]:
                    if not other.endswith(f"/p2p/{host.peer_id}"):
                        dials.start_soon(host.connect, other)
        if dialing.cancelled_caught:
            raise BenchError(f"could not connect to every peer within {args.timeout} s")
        emit(proto, event="ready")

        while True:
            cmd = await lines.next()
            if cmd is None or cmd.get("cmd") == "quit":
                break
            r = int(cmd["round"])
            sent0 = sum(host.bytes_sent.values())
            meter.start()
            t0 = time.perf_counter()
            payload = codec.encode(data)
            encode_s = time.perf_counter() - t0
            spec = RoundSpec(RoundKey(args.run_id, 0, r), members, numel, args.codec)
            outcome = await run_allreduce(
                host,
                mailbox,
                spec,
                payload,
                1.0,
                phase_timeout_s=args.timeout,
                round_timeout_s=args.timeout,
            )
            wall = time.perf_counter() - t0
            cpu, tcp = meter.stop()
            sent = sum(host.bytes_sent.values()) - sent0
            if not isinstance(outcome, Done):
                raise BenchError(f"round {r} failed: {outcome.reason}")
            emit(
                proto,
                event="round",
                round=r,
                wall_s=wall,
                encode_s=encode_s,
                cpu_s=cpu,
                bytes=sent,
                tcp=tcp,
            )
            averaged = outcome.averaged
            cmd = await lines.next()  # checked once every peer is done: never on the clock
            if cmd is None or cmd.get("cmd") != "check":
                raise BenchError(f"expected the check of round {r}, got {cmd!r}")
            err = float(np.max(np.abs(averaged - mean))) if numel else 0.0
            emit(proto, event="checked", round=r, err=err)
        nursery.cancel_scope.cancel()


def _hivemind_peer(args: argparse.Namespace, proto: IO[str]) -> None:
    """One hivemind peer: a DHT (peer 0 first, the others joining it), an averager."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import NoCompression

    numel = numel_of(args.mb)
    data = peer_data(args.seed, args.index, numel)
    emit(proto, event="up")

    def read() -> Msg:
        line = sys.stdin.readline()
        if not line:
            raise BenchError("the parent closed the pipe")
        msg: Msg = json.loads(line)
        return msg

    cmd = read()
    mean = torch.from_numpy(np.load(cmd["mean"]))
    dht = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=cmd["initial_peers"]
    )
    tensor = torch.from_numpy(data.copy())
    averager = hivemind.averaging.DecentralizedAverager(
        [tensor],
        dht,
        start=True,
        prefix="atoll_bench",
        target_group_size=args.peers,
        min_group_size=args.peers,
        compression=NoCompression(),
        allreduce_timeout=args.timeout,
    )
    emit(
        proto,
        event="ready",
        addrs=[str(a) for a in dht.get_visible_maddrs()],
        version=hivemind.__version__,
        torch=torch.__version__,
    )
    meter = Meter()
    control: Any = None
    try:
        while True:
            cmd = read()
            if cmd.get("cmd") == "quit":
                break
            r = int(cmd["round"])
            if cmd["cmd"] == "match":  # untimed: reset the vector and find the group
                with averager.get_tensors() as tensors:
                    tensors[0].copy_(torch.from_numpy(data))
                control = averager.step(
                    weight=1.0, wait=False, require_trigger=True, timeout=args.timeout
                )
                deadline = time.monotonic() + args.timeout
                while control.stage != AveragingStage.AWAITING_TRIGGER:
                    if control.done() or time.monotonic() > deadline:
                        control.result(timeout=0)  # raises the averager's error
                        raise BenchError(f"round {r}: no group within {args.timeout} s")
                    time.sleep(0.01)
                emit(proto, event="matched", round=r)
                continue
            meter.start()
            t0 = time.perf_counter()
            control.allow_allreduce()
            control.result(timeout=args.timeout)
            wall = time.perf_counter() - t0
            cpu, tcp = meter.stop()
            emit(proto, event="round", round=r, wall_s=wall, cpu_s=cpu, bytes=tcp, tcp=tcp)
            if read().get("cmd") != "check":
                raise BenchError(f"expected the check of round {r}")
            with averager.get_tensors() as tensors:
                err = float((tensors[0] - mean).abs().max()) if numel else 0.0
            emit(proto, event="checked", round=r, err=err)
    finally:
        averager.shutdown()
        dht.shutdown()


# --------------------------------------------------------------------------------------
# the parent
# --------------------------------------------------------------------------------------
class Worker:
    """A peer process seen from the parent: JSON lines in and out, a log file."""

    def __init__(self, argv: list[str], log_path: Path, name: str) -> None:
        self.name = name
        self.log_path = log_path
        with log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env={**os.environ, **QUIET_ENV},
                start_new_session=True,  # its own process group: stop() ends its children too
            )
        self._buf = b""

    def send(self, **msg: Any) -> None:
        """Send a command."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            raise BenchError(f"{self.name} is gone ({e}); see {self.log_path}") from None

    def recv(self, timeout_s: float, expect: str) -> Msg:
        """The next message, which must be an ``expect`` event."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{self.name}: no {expect!r} within {timeout_s:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.proc.wait(timeout=30)
                    raise BenchError(
                        f"{self.name} exited ({code}) before {expect!r}: {self.last_log_line()}"
                    )
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: Msg = json.loads(line)
        if msg.get("event") == "error":
            raise BenchError(str(msg.get("error")))
        if msg.get("event") != expect:
            raise BenchError(f"{self.name}: expected {expect!r}, got {msg!r}")
        return msg

    def last_log_line(self) -> str:
        """The last line of the worker's log, for an error message."""
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        return lines[-1] if lines else f"(empty log {self.log_path})"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask it to quit (stdin EOF); past ``timeout_s`` kill its process group."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit within %.0f s: killed", self.name, timeout_s)
        # leftovers (hivemind's DHT, averager and p2pd processes) share its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def run_side(
    kind: str, python: str, args: argparse.Namespace, mean_path: Path, workdir: Path
) -> Msg:
    """Start the peers of ``kind`` ("atoll" or "hivemind"), run the rounds, stop them."""
    n = args.peers
    run_id = secrets.token_hex(32)
    common = [
        "--peers", str(n), "--mb", repr(args.mb), "--codec", args.codec,
        "--seed", str(args.seed), "--timeout", repr(args.timeout), "--run-id", run_id,
    ]  # fmt: skip
    workers = [
        Worker(
            [python, str(HERE), "--worker", kind, "--index", str(i), *common],
            workdir / f"{kind}-peer{i}.log",
            f"{kind} peer {i}",
        )
        for i in range(n)
    ]
    side: Msg = {"round_s": [], "bytes_sent_per_peer": [], "tcp_bytes_sent_per_peer": []}
    side.update({"encode_s": [], "cpu_s": [], "other_cpu_s": [], "max_abs_error_per_round": []})
    side["peer_round_s"] = []
    try:
        ups = [w.recv(START_TIMEOUT_S, "up") for w in workers]
        if kind == "atoll":
            addrs = [u["addr"] for u in ups]
            for w in workers:
                w.send(cmd="peers", addrs=addrs, mean=str(mean_path))
            for w in workers:
                w.recv(START_TIMEOUT_S + args.timeout, "ready")
        else:
            workers[0].send(cmd="peers", initial_peers=[], mean=str(mean_path))
            first = workers[0].recv(START_TIMEOUT_S, "ready")
            side["version"], side["torch"] = first["version"], first["torch"]
            side["codec"] = "fp32"
            for w in workers[1:]:
                w.send(cmd="peers", initial_peers=first["addrs"], mean=str(mean_path))
            for w in workers[1:]:
                w.recv(START_TIMEOUT_S, "ready")
        log.info("%s: %d peers up", kind, n)
        for r in range(args.rounds):
            if kind == "hivemind":
                for w in workers:
                    w.send(cmd="match", round=r)
                for w in workers:
                    w.recv(args.timeout + 30, "matched")
            busy0 = machine_cpu_s()
            for w in workers:
                w.send(cmd="round", round=r)
            results = [w.recv(args.timeout + 60, "round") for w in workers]
            busy1 = machine_cpu_s()
            # the error against the true mean is computed after every peer is done, so
            # that no peer's check takes CPU from a peer still in the round
            for w in workers:
                w.send(cmd="check", round=r)
            for w, result in zip(workers, results, strict=True):
                result["err"] = w.recv(START_TIMEOUT_S + args.timeout, "checked")["err"]
            _add_round(side, results)
            if busy0 is not None and busy1 is not None:  # what others ran meanwhile
                side["other_cpu_s"].append(max(0.0, busy1 - busy0 - side["cpu_s"][-1]))
            log.info("%s round %d: %.3f s", kind, r, side["round_s"][-1])
        for w in workers:
            w.send(cmd="quit")
    finally:
        for w in workers:
            w.stop()
    if kind == "hivemind":
        del side["encode_s"]  # its serialization is not timed apart
    side["round_s_median"] = statistics.median(side["round_s"])
    side["max_abs_error"] = max(side["max_abs_error_per_round"])
    return side


def _add_round(side: Msg, results: list[Msg]) -> None:
    walls = [float(m["wall_s"]) for m in results]
    side["peer_round_s"].append(walls)
    side["round_s"].append(max(walls))
    side["encode_s"].append(max(float(m.get("encode_s", 0.0)) for m in results))
    side["cpu_s"].append(sum(float(m["cpu_s"]) for m in results))
    side["max_abs_error_per_round"].append(max(float(m["err"]) for m in results))
    side["bytes_sent_per_peer"].append(_mean_or_none([m["bytes"] for m in results]))
    side["tcp_bytes_sent_per_peer"].append(_mean_or_none([m["tcp"] for m in results]))


def _mean_or_none(values: list[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if len(known) == len(values) and known else None


def machine_info() -> Msg:
    """What the numbers were measured on."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model,
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
    }


def _ratios(atoll: Msg, hive: Msg) -> Msg:
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def med(xs: list[Any]) -> float | None:
        known = [x for x in xs if x is not None]
        return statistics.median(known) if known else None

    return {
        "round_s": ratio(atoll["round_s_median"], hive["round_s_median"]),
        "tcp_bytes_sent_per_peer": ratio(
            med(atoll["tcp_bytes_sent_per_peer"]), med(hive["tcp_bytes_sent_per_peer"])
        ),
        "cpu_s": ratio(med(atoll["cpu_s"]), med(hive["cpu_s"])),
        "note": "atoll / hivemind, medians over rounds",
    }


def table(report: Msg) -> str:
    """A short human summary of the report."""
    sides = [("atoll " + report["codec"], report)]
    if "hivemind" in report:
        sides.append(("hivemind fp32", report["hivemind"]))

    def mb(x: float | None) -> str:
        return "-" if x is None else f"{x / 2**20:.1f}"

    cfg = report["config"]
    out = [
        f"{cfg['peers']} peers x {cfg['mb']} MB, {cfg['rounds']} rounds, "
        f"{report['machine']['cpu_count']} cpus",
        f"{'':14} {'round s (each)':>24} {'median':>7} {'MB sent':>8} {'TCP MB':>7} "
        f"{'cpu s':>6} {'other':>6} {'max err':>9}",
    ]
    for name, s in sides:
        rounds = " ".join(f"{x:.2f}" for x in s["round_s"])
        other = f"{max(s['other_cpu_s']):.2f}" if s["other_cpu_s"] else "-"
        out.append(
            f"{name:14} {rounds:>24} {s['round_s_median']:7.2f} "
            f"{mb(s['bytes_sent_per_peer'][-1]):>8} {mb(s['tcp_bytes_sent_per_peer'][-1]):>7} "
            f"{statistics.median(s['cpu_s']):6.2f} {other:>6} {s['max_abs_error']:9.2e}"
        )
    if "ratios" in report:
        r = report["ratios"]
        out.append(
            "atoll/hivemind: "
            + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if isinstance(v, float))
        )
    out.append(f"bandwidth-optimal MB per peer: {mb(report['optimal_bytes_per_peer'])}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check the arguments; a bad one exits with a one-line error."""
    p = _Parser(
        prog="allreduce.py",
        description="All-reduce round time of atoll over real processes (and hivemind's).",
    )
    p.add_argument("--peers", type=int, help="peer processes (default 4; --quick 3)")
    p.add_argument("--mb", type=float, help="MiB of float32 per peer (default 100; --quick 1)")
    p.add_argument("--rounds", type=int, help="rounds (default 3; --quick 2)")
    p.add_argument("--codec", default="fp32", help=f"atoll codec: {', '.join(CODECS)}")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--quick", action="store_true", help="3 peers, 1 MB, 2 rounds")
    p.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per phase/round")
    p.add_argument("--compare-hivemind", action="store_true", help="run hivemind 1.1.12 too")
    p.add_argument(
        "--hivemind-python",
        help=f"Python with hivemind (default {HIVEMIND_VENV_PYTHON} if present, else this one)",
    )
    p.add_argument(
        "--verify-owners",
        action="store_true",
        help="in process: plain vs verified chunk owners, side by side",
    )
    p.add_argument(
        "--verify-peers",
        default="4,8",
        help="group sizes for --verify-owners, comma-separated (default 4,8)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    # worker mode (the parent starts this file with these)
    p.add_argument("--worker", choices=["atoll", "hivemind"], help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-id", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    quick = args.quick
    args.peers = args.peers if args.peers is not None else (3 if quick else 4)
    args.mb = args.mb if args.mb is not None else (1.0 if quick else 100.0)
    args.rounds = args.rounds if args.rounds is not None else (2 if quick else 3)
    if not 2 <= args.peers <= 64:
        p.error(f"--peers must be between 2 and 64, not {args.peers}")
    if not (math.isfinite(args.mb) and args.mb > 0):
        p.error(f"--mb must be a positive number, not {args.mb}")
    if numel_of(args.mb) < args.peers:
        p.error(f"--mb {args.mb} holds fewer float32 values than there are peers")
    if args.mb > 2048:
        p.error(f"--mb {args.mb} is over 2048 (a frame carries at most 4 GiB)")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, not {args.rounds}")
    if args.codec not in CODECS:
        p.error(f"--codec must be one of {', '.join(CODECS)}, not {args.codec!r}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error(f"--timeout must be a positive number of seconds, not {args.timeout}")
    try:
        args.verify_peers = [int(x) for x in str(args.verify_peers).split(",") if x.strip()]
    except ValueError:
        p.error(f"--verify-peers must be comma-separated integers, not {args.verify_peers!r}")
    if not args.verify_peers or not all(2 <= n <= 64 for n in args.verify_peers):
        p.error("--verify-peers sizes must lie between 2 and 64")
    if args.worker is None:
        if args.verify_owners and args.compare_hivemind:
            p.error("--verify-owners runs in process and cannot --compare-hivemind")
        if args.json is not None and args.json.is_dir():
            p.error(f"--json {args.json} is a directory")
        if args.compare_hivemind:
            args.hivemind_python = _check_hivemind(p, args.hivemind_python)
        elif args.hivemind_python:
            p.error("--hivemind-python needs --compare-hivemind")
    return args


def _check_hivemind(p: _Parser, python: str | None) -> str:
    if python is None:
        python = str(HIVEMIND_VENV_PYTHON) if HIVEMIND_VENV_PYTHON.exists() else sys.executable
    probe = "import hivemind, torch; print(hivemind.__version__)"
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except OSError as e:
        p.error(f"--hivemind-python {python} cannot run: {e.strerror}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        p.error(
            f"{python} cannot import hivemind ({last}); make a venv with torch and "
            "hivemind==1.1.12 (see this file's docstring) and pass --hivemind-python"
        )
    version = done.stdout.strip()
    if version != "1.1.12":
        log.warning("comparing against hivemind %s, not 1.1.12", version)
    return python


# --------------------------------------------------------------------------------------
# verified chunk owners, in process
# --------------------------------------------------------------------------------------
def verify_round(peers: int, numel: int, codec: str, seed: int, round_: int, verify: bool) -> Msg:
    """One in-process round of ``peers`` members, plain or with verified owners."""
    from collections import deque

    from atoll.protocol.allreduce import AllReduceRound, Done, RoundKey, RoundSpec, Send
    from atoll.protocol.messages import decode_message, encode_message

    members = tuple(f"peer{i}" for i in range(peers))
    spec = RoundSpec(
        RoundKey("bench-verify", 0, round_), members, numel, codec, verify_owners=verify
    )
    c = spec.make_codec()
    payloads = [c.encode(peer_data(seed, i, numel)) for i in range(peers)]
    busy = dict.fromkeys(members, 0.0)
    wire = dict.fromkeys(members, 0)
    count = dict.fromkeys(members, 0)
    results: dict[str, object] = {}
    queue: deque[tuple[str, object]] = deque()
    wall0 = time.perf_counter()
    machines = {}
    for i, m in enumerate(members):
        t0 = time.perf_counter()
        machines[m] = AllReduceRound(
            spec, m, payloads[i], 1.0, now=0.0, phase_timeout=1e9, round_timeout=1e9
        )
        busy[m] += time.perf_counter() - t0

    def handle(src: str, actions: list[Any]) -> None:
        for act in actions:
            if isinstance(act, Send):
                raw = encode_message(act.message)
                wire[src] += 4 + len(raw)  # a frame: a 4-byte length, then the message
                count[src] += 1
                queue.append((act.to, raw))
            else:
                results[src] = act

    for m in members:
        t0 = time.perf_counter()
        out = machines[m].start()
        busy[m] += time.perf_counter() - t0
        handle(m, out)
    while queue:
        to, raw = queue.popleft()
        t0 = time.perf_counter()
        msg = decode_message(raw)
        out = machines[to].receive(msg, now=0.0)  # type: ignore[arg-type]
        busy[to] += time.perf_counter() - t0
        handle(to, out)
    wall = time.perf_counter() - wall0
    if not all(isinstance(results.get(m), Done) for m in members):
        raise BenchError(f"an in-process round failed: {results}")
    return {
        "wall_s": wall,
        "busy_s_max": max(busy.values()),
        "wire_bytes_sent_per_member": statistics.mean(wire.values()),
        "payload_bytes_sent_per_member": statistics.mean(machines[m].bytes_sent for m in members),
        "messages_per_member": statistics.mean(count.values()),
    }


def run_verify(args: argparse.Namespace) -> Msg:
    """Plain and verified rounds side by side for every size of ``--verify-peers``."""
    from atoll.protocol.codecs import make_codec

    numel = numel_of(args.mb)
    encoded = make_codec(args.codec).encoded_size(numel)
    report: Msg = {
        "mode": "verify-owners, in process",
        "config": {"mb": args.mb, "numel": numel, "rounds": args.rounds, "seed": args.seed},
        "codec": args.codec,
        "encoded_bytes": encoded,
        "machine": machine_info(),
        "groups": {},
    }
    for n in args.verify_peers:
        group: Msg = {}
        for name, verify in (("plain", False), ("verified", True)):
            rounds = [
                verify_round(n, numel, args.codec, args.seed, r, verify) for r in range(args.rounds)
            ]
            side: Msg = {k: [r[k] for r in rounds] for k in rounds[0]}
            side["median_wall_s"] = statistics.median(side["wall_s"])
            side["median_busy_s_max"] = statistics.median(side["busy_s_max"])
            group[name] = side
        p, v = group["plain"], group["verified"]
        group["ratios"] = {
            "wire_bytes": v["wire_bytes_sent_per_member"][0] / p["wire_bytes_sent_per_member"][0],
            "busy_s_max": v["median_busy_s_max"] / p["median_busy_s_max"],
            "wall_s": v["median_wall_s"] / p["median_wall_s"],
        }
        group["predicted_payload_bytes"] = {
            "plain": 2 * (n - 1) * encoded / n,
            "verified": 3 * (n - 1) * encoded / n,
        }
        report["groups"][str(n)] = group
    report["machine"]["loadavg_at_end"] = list(os.getloadavg())
    return report


def verify_table(report: Msg) -> str:
    """The human summary of a ``--verify-owners`` report."""
    lines = [
        f"verified owners, {report['codec']}, {report['config']['mb']} MiB, "
        f"{report['config']['rounds']} rounds (medians)",
        f"{'peers':>5} {'mode':>9} {'MB sent':>8} {'msgs':>5} {'busy s':>7} {'wall s':>7}",
    ]
    for n, g in report["groups"].items():
        for name in ("plain", "verified"):
            s = g[name]
            lines.append(
                f"{n:>5} {name:>9} {s['wire_bytes_sent_per_member'][0] / 1e6:>8.2f} "
                f"{s['messages_per_member'][0]:>5.0f} {s['median_busy_s_max']:>7.3f} "
                f"{s['median_wall_s']:>7.3f}"
            )
        r = g["ratios"]
        lines.append(
            f"{n:>5} {'ratio':>9} {r['wire_bytes']:>8.3f} {'':>5} {r['busy_s_max']:>7.3f} "
            f"{r['wall_s']:>7.3f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with --worker, one peer of it)."""
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.verify_owners:
        try:
            vreport = run_verify(args)
        except BenchError as e:
            print(f"allreduce.py: error: {e}", file=sys.stderr)
            return 1
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(vreport, indent=2) + "\n")
        print(verify_table(vreport))
        return 0
    from atoll.protocol.codecs import make_codec

    numel = numel_of(args.mb)
    encoded = make_codec(args.codec).encoded_size(numel)
    report: Msg = {
        "config": {
            "peers": args.peers,
            "mb": args.mb,
            "numel": numel,
            "rounds": args.rounds,
            "seed": args.seed,
            "timeout_s": args.timeout,
        },
        "codec": args.codec,
        "encoded_bytes": encoded,
        "optimal_bytes_per_peer": 2 * (args.peers - 1) / args.peers * encoded,
        "machine": machine_info(),
    }
    workdir = Path(tempfile.mkdtemp(prefix="atoll-bench-allreduce-"))
    ok = False
    try:
        mean_path = workdir / "mean.npy"
        np.save(mean_path, true_mean(args.seed, args.peers, numel))
        sides: list[tuple[str, str, Callable[[Msg], None]]] = [
            ("atoll", sys.executable, report.update)
        ]
        if args.compare_hivemind:
            sides.append(("hivemind", args.hivemind_python, _setter(report, "hivemind")))
        for kind, python, store in sides:
            store(run_side(kind, python, args, mean_path, workdir))
        report["machine"]["loadavg_at_end"] = list(os.getloadavg())
        if "hivemind" in report:
            report["ratios"] = _ratios(report, report["hivemind"])
        ok = True
    except BenchError as e:
        print(f"allreduce.py: error: {e} (logs in {workdir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"allreduce.py: interrupted (logs in {workdir})", file=sys.stderr)
        return 130
    finally:
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


def _setter(report: Msg, key: str) -> Callable[[Msg], None]:
    def store(side: Msg) -> None:
        report[key] = side

    return store


if __name__ == "__main__":
    sys.exit(main())
