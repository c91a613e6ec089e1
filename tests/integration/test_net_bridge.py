"""The trainer/network-process bridge with a real spawned process and shared memory.

The network side is :func:`atoll.node.net.bridge.local_engine_worker`: an OuterEngine
with a loopback exchange, so results can be compared bit for bit with an in-process
engine. Each test starts one network process (about a second).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from atoll.node.data import Batcher, Corpus
from atoll.node.model import build
from atoll.node.net.bridge import (
    DIED,
    NetworkBridge,
    NetworkProcessDied,
    NetworkStartError,
    SharedFragments,
    SyncOutcome,
    WarmWorker,
)
from atoll.node.net.status import NodeStatus
from atoll.node.train import InnerConfig, Replica
from atoll.protocol.engine import EngineConfig, OuterEngine, average_requests, merge
from atoll.protocol.errors import ConfigError
from atoll.protocol.schedule import Schedule

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKER = "atoll.node.net.bridge:local_engine_worker"
SIZES = [1000, 257, 4096]
CONFIG = EngineConfig(H=12, tau=1, alpha=0.5, codec="e3m0")


@pytest.fixture
def shared() -> Iterator[SharedFragments]:
    sh = SharedFragments.create(SIZES)
    rng = np.random.default_rng(7)
    for p in range(len(sh)):
        sh.global_(p)[:] = rng.standard_normal(SIZES[p], dtype=np.float32)
    names = list(sh.names)
    yield sh
    sh.close()
    sh.unlink()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)


def _bridge(shared: SharedFragments, **args: object) -> NetworkBridge:
    return NetworkBridge(shared, WORKER, {"config": CONFIG, "seed": 3, **args})


def test_end_to_end_bit_for_bit(shared: SharedFragments) -> None:
    initial = [shared.global_(p).copy() for p in range(len(shared))]
    ref = OuterEngine(CONFIG, Schedule(CONFIG.H, len(SIZES)), initial, seed=3)
    rng = np.random.default_rng(11)
    tokens = ref_tokens = 0
    with _bridge(shared) as bridge:
        # two rounds of every fragment, interleaved as a schedule would start them
        for r in range(2):
            for p in range(len(SIZES)):
                step = r * CONFIG.H + 4 * p + 3
                tokens += 512 * (p + 1)
                local = initial[p] - 0.01 * rng.standard_normal(SIZES[p], dtype=np.float32)
                shared.local(p)[:] = local
                bridge.start_sync(p, step, tokens)
                assert bridge.in_flight(p)
                with pytest.raises(ConfigError):
                    bridge.start_sync(p, step, tokens)  # one in flight per fragment
                out = bridge.wait(p, 10.0)
                assert out == SyncOutcome(p, step, True, r), out
                assert not bridge.in_flight(p)

                ref.add_tokens(tokens - ref_tokens)
                ref_tokens = tokens
                req = ref.begin(p, local, step)
                averaged, _ = average_requests([req], ref.codec, CONFIG.aggregation)
                ref.deliver(p, averaged, req.round)
                got = shared.global_(p)
                assert got.tobytes() == ref.global_params(p).tobytes()
                assert merge(local, got, CONFIG.alpha).tobytes() == ref.merge(p, local).tobytes()
        assert bridge.stats.started == bridge.stats.applied == 6
        assert bridge.stats.skipped == bridge.stats.failed == 0
        assert bridge.poll() == []
    assert not bridge.alive


def test_wait_times_out_then_poll_gets_the_outcome(shared: SharedFragments) -> None:
    with _bridge(shared, delay_s=1.5) as bridge:
        before = shared.global_(1).copy()
        shared.local(1)[:] = before + 0.1
        bridge.start_sync(1, 5, 100)
        t0 = time.monotonic()
        assert bridge.wait(1, 0.2) is None
        waited = time.monotonic() - t0
        assert 0.19 <= waited < 5.0, waited  # its own bound, plus a busy machine's slack
        assert bridge.stats.skipped == 1 and bridge.in_flight(1)
        assert bridge.poll() == []
        deadline = time.monotonic() + 60
        got: list[SyncOutcome] = []
        while not got and time.monotonic() < deadline:
            got = bridge.poll()
            time.sleep(0.05)
        assert got == [SyncOutcome(1, 5, True, 0)]
        assert not np.array_equal(shared.global_(1), before)
        assert not bridge.in_flight(1)


def test_a_hold_keeps_the_trainer_waiting_until_the_outcome(shared: SharedFragments) -> None:
    # the sync waits for peers due at its slot: the trainer waits past its own bound
    with _bridge(shared, delay_s=1.5, hold_s=30.0) as bridge:
        shared.local(1)[:] = shared.global_(1) + 0.1
        bridge.start_sync(1, 5, 100)
        t0 = time.monotonic()
        got = bridge.wait(1, 0.2)
        waited = time.monotonic() - t0
        assert got == SyncOutcome(1, 5, True, 0), got
        assert 1.4 <= waited < 20.0, waited
        assert (bridge.stats.held, bridge.stats.skipped) == (1, 0)
        # the next sync is not held by the last one's hold: a new start clears it
        bridge.start_sync(1, 17, 200)
        assert bridge.wait(1, 20.0) == SyncOutcome(1, 17, True, 1)
        assert bridge.stats.held == 1


def test_a_released_hold_lets_the_trainer_go_on(shared: SharedFragments) -> None:
    with _bridge(shared, delay_s=3.0, hold_s=30.0, release_after_s=1.0) as bridge:
        shared.local(0)[:] = shared.global_(0) + 0.1
        bridge.start_sync(0, 3, 100)
        t0 = time.monotonic()
        assert bridge.wait(0, 0.2) is None  # released before the outcome came
        waited = time.monotonic() - t0
        assert 0.9 <= waited < 3.0 + 10.0, waited
        assert (bridge.stats.held, bridge.stats.skipped) == (1, 1)
        assert bridge.wait(0, 30.0) == SyncOutcome(0, 3, True, 0)  # it still comes


def test_failures_are_reported_and_change_nothing(shared: SharedFragments) -> None:
    with _bridge(shared, fail_every=2) as bridge:
        shared.local(0)[:] = shared.global_(0) - 0.05
        bridge.start_sync(0, 3, 100)
        assert bridge.wait(0, 10.0) == SyncOutcome(0, 3, True, 0)
        after_first = shared.global_(0).copy()
        shared.local(0)[:] = after_first - 0.05
        bridge.start_sync(0, 15, 200)
        assert bridge.wait(0, 10.0) == SyncOutcome(0, 15, False, 1, "injected fault")
        assert np.array_equal(shared.global_(0), after_first)  # a failed round applies nothing
        bridge.start_sync(0, 27, 300)
        assert bridge.wait(0, 10.0) == SyncOutcome(0, 27, True, 1)  # same round, retried
        # input the codec refuses: an AtollError in the worker is a failed round, not a crash
        shared.local(2)[:] = np.nan
        bridge.start_sync(2, 11, 400)
        out = bridge.wait(2, 10.0)
        assert out is not None and not out.applied and "CodecError" in out.reason, out
        assert bridge.alive
        assert (bridge.stats.applied, bridge.stats.failed) == (2, 2)
        # the worker's status arrives typed, before each outcome (the NaN round never began)
        status = bridge.status
        assert (status.peer_id, status.rounds_applied, status.rounds_failed) == ("local", 2, 1)
        assert status.versions == (2, 0, 0) and status.last_sync == {0: "applied"}


def test_status_messages_old_info_and_bad_ones(shared: SharedFragments) -> None:
    with _bridge(shared) as bridge:
        assert bridge.status == NodeStatus()  # nothing sent yet
        # messages as the network process sends them, handed to the trainer's reader
        bridge._handle(["status", NodeStatus(peer_id="a", rounds_applied=3).to_wire()])
        bridge._handle(["info", {"swarm_step": 40, "last_sync": {"1": "rebased v2"}}])
        want = NodeStatus(peer_id="a", rounds_applied=3, swarm_step=40, last_sync={1: "rebased v2"})
        assert bridge.status == want
        bridge._handle(["info", {"swarm_step": "soon"}])  # a worker's bug: logged, dropped
        bridge._handle(["status", [1, 2]])
        bridge._handle(["status"])
        assert bridge.status == want and bridge.alive


def test_network_process_killed_mid_round(shared: SharedFragments) -> None:
    bridge = _bridge(shared, delay_s=30.0)
    try:
        shared.local(0)[:] = shared.global_(0)
        bridge.start_sync(0, 3, 100)
        bridge.start_sync(1, 7, 100)
        assert bridge.pid is not None
        os.kill(bridge.pid, signal.SIGKILL)
        t0 = time.monotonic()
        out = bridge.wait(0, 5.0)
        assert time.monotonic() - t0 < 5.0  # the death is seen at once, not at the wait's end
        assert out == SyncOutcome(0, 3, False, -1, DIED)
        assert bridge.poll() == [SyncOutcome(1, 7, False, -1, DIED)]
        assert not bridge.alive
        with pytest.raises(NetworkProcessDied, match="exit code -9"):
            bridge.start_sync(0, 15, 200)
        with pytest.raises(NetworkProcessDied):
            bridge.poll()
    finally:
        t0 = time.monotonic()
        bridge.close()
        assert time.monotonic() - t0 < 2.0


def test_start_failure_is_a_clear_error(shared: SharedFragments) -> None:
    t0 = time.monotonic()
    with pytest.raises(NetworkStartError, match="ModuleNotFoundError"):
        NetworkBridge(shared, "atoll.no_such_module:main", {})
    assert time.monotonic() - t0 < 60.0  # a spawned Python fails its import: seconds, if busy


def test_a_network_process_started_ahead_is_taken_over_and_runs_syncs(
    shared: SharedFragments,
) -> None:
    """The node starts its network process before it builds its model (the process
    imports its libraries meanwhile) and the bridge takes it over."""
    with WarmWorker(WORKER) as warm:
        pid = warm.proc.pid
        with NetworkBridge(shared, WORKER, {"config": CONFIG, "seed": 3}, warm=warm) as bridge:
            assert bridge.pid == pid
            shared.local(0)[:] = shared.global_(0) - 0.01
            bridge.start_sync(0, 3, 512)
            assert bridge.wait(0, 10.0) == SyncOutcome(0, 3, True, 0)
        assert not bridge.alive
        with pytest.raises(ConfigError, match="handed to a bridge already"):
            warm.go(shared, {})


def test_a_network_process_started_ahead_and_not_taken_is_ended_at_once() -> None:
    """A node that fails before its bridge starts (a bad identity, say) leaves no
    process behind, and does not wait for it."""
    warm = WarmWorker(WORKER)
    t0 = time.monotonic()
    warm.close()
    assert time.monotonic() - t0 < 5.0
    assert not warm.proc.is_alive()
    warm.close()  # once is enough


def test_a_network_process_started_ahead_for_another_worker_is_refused(
    shared: SharedFragments,
) -> None:
    with (
        WarmWorker("atoll.node.net.swarm:swarm_worker") as warm,
        pytest.raises(ConfigError, match=r"not atoll\.node\.net\.bridge"),
    ):
        NetworkBridge(shared, WORKER, {}, warm=warm)
    with pytest.raises(ConfigError, match="module:function"):
        WarmWorker("no-colon")


def test_the_trainer_yields_the_cpu_to_its_network_process_once_it_is_started() -> None:
    """The node daemon starts its network process, then lowers its own CPU priority: the
    network process keeps the priority the node started with."""
    script = (
        "import os\n"
        "from atoll.node.daemon import TRAINER_NICE, WORKER, _yield_to_the_network\n"
        "from atoll.node.net.bridge import WarmWorker\n"
        "with WarmWorker(WORKER) as warm:\n"
        "    before = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "    _yield_to_the_network()\n"
        "    mine = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "    net = os.getpriority(os.PRIO_PROCESS, warm.proc.pid)\n"
        "    print(before, mine, net, TRAINER_NICE)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    before, mine, net, nice = (int(x) for x in out.stdout.split())
    assert mine == min(before + nice, 19) and net == before, out.stdout


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_trainer_keeps_its_step_rate_while_the_network_process_works() -> None:
    """Compute utilisation: step rate with a CPU-busy network process vs. with none.

    One torch thread: on 2 shared, oversubscribed cores two intra-op threads spin at
    their barriers and a step took ~100x longer (measured), which would swamp the effect.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone, bridged, child_cores = _measure_rates(steps=40)
    finally:
        torch.set_num_threads(threads)
    ratio = bridged / alone
    print(
        f"\ntrainer steps/s alone {alone:.2f}, with a busy network process {bridged:.2f}: "
        f"ratio {ratio:.2f}; the network process used {child_cores:.2f} cores; "
        f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}"
    )
    assert child_cores > 0.1  # the load really ran
    assert ratio > 0.3


def _measure_rates(steps: int) -> tuple[float, float, float]:
    torch.manual_seed(0)
    data = np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8)
    corpus = Corpus("random", data[:180_000], data[180_000:], "0" * 64)
    model, seq_len = build("tiny", 0)
    batcher = Batcher(corpus, seq_len, 4)
    rep = Replica(model, InnerConfig(warmup=5, total_steps=200), batcher, 0, torch.device("cpu"))

    def rate(first: int) -> float:
        t0 = time.perf_counter()
        for s in range(first, first + steps):
            rep.train_step(s)
        return steps / (time.perf_counter() - t0)

    for s in range(3):  # warm-up
        rep.train_step(s)
    alone = rate(3)
    with SharedFragments.create([1 << 16]) as sh, _bridge_load(sh) as bridge:
        sh.local(0)[:] = 0.5
        bridge.start_sync(0, 3, 100)
        assert bridge.pid is not None
        # the round's CPU load is under way once the child has burnt a little CPU time
        start_cpu, deadline = _cpu_s(bridge.pid), time.monotonic() + 60
        while _cpu_s(bridge.pid) < start_cpu + 0.1:
            assert time.monotonic() < deadline, "the network process never got busy"
            time.sleep(0.01)
        cpu0, t0 = _cpu_s(bridge.pid), time.perf_counter()
        bridged = rate(3 + steps)
        child_cores = (_cpu_s(bridge.pid) - cpu0) / (time.perf_counter() - t0)
        assert bridge.poll() == []  # the round was in flight all along
    return alone, bridged, child_cores


def _bridge_load(sh: SharedFragments) -> NetworkBridge:
    cfg = EngineConfig(H=12, tau=1, codec="e3m0")
    return NetworkBridge(sh, WORKER, {"config": cfg, "load_s": 60.0, "load_numel": 1 << 20})
