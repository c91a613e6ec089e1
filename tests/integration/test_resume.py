"""Checkpoints of real ``atoll node`` processes: a node stopped with Ctrl+C leaves within
seconds and writes a last checkpoint; started again with the same identity it resumes
from it (its step, its weights and its fragments' global copies), fetching only what the
swarm moved past; a torn newest checkpoint is passed over for the one before.

Two nodes and a bootstrap on 127.0.0.1; every wait has a deadline.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from atoll.node.checkpoint import CheckpointStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

RUN = {"total_steps": 400, "H": 12, "tau": 2, "blocks_per_fragment": 2}
FAST = ("--checkpoint-every-s", "3", "--checkpoint-keep", "3")
LEAVE_BOUND_S = 5.0  # Ctrl+C to exit, on an idle machine; the test allows for a busy one


def _folders(tmp: Path) -> list[Path]:
    return sorted((tmp / "checkpoints").glob("*/*"))


def _store_of(tmp: Path, peer_id: str) -> CheckpointStore:
    (folder,) = [f for f in _folders(tmp) if peer_id.endswith(f.name)]
    return CheckpointStore(folder, read_only=True)


def _applied_rounds(node: Any) -> int:
    return int(node.progress.get("rounds_applied", 0))


def test_a_stopped_node_leaves_quickly_and_resumes_where_it_stopped(
    local_swarm: Any, wait_until: Any, tmp_path: Path
) -> None:
    run = local_swarm.write_manifest("resume", local_swarm.manifest("resume-test", **RUN))
    local_swarm.start_bootstrap()
    a = local_swarm.start_node("a", run, steps=0, wait_peers=1, extra=FAST)
    b = local_swarm.start_node("b", run, steps=0, wait_peers=1, extra=FAST)
    # both apply rounds, and b wrote a periodic checkpoint after one of them
    wait_until(lambda: _applied_rounds(a) >= 2 and _applied_rounds(b) >= 2, 240, "rounds")
    peer_b = b.progress["peer_id"]
    wait_until(lambda: _store_of(tmp_path, peer_b).list(), 60, "b's first checkpoint")

    b.proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    assert b.wait(60) == 0, b.tail()
    left_s = time.monotonic() - t0
    assert left_s < 3 * LEAVE_BOUND_S, f"b took {left_s:.1f} s to leave"
    first = b.summary
    assert first is not None and first["stopped_by"] == "SIGINT"
    assert first["checkpoint"]["saved"] >= 2, first["checkpoint"]  # a periodic one and the last
    newest = _store_of(tmp_path, peer_b).latest()
    assert newest is not None
    assert newest.meta["step"] == first["final_step"]
    assert newest.meta["versions"] == list(first["info"]["versions"])

    # started again with the same identity: it resumes, and trains on from that step, or
    # from the swarm's when a trained on past it meanwhile (a's record states its step,
    # republished at least every period)
    a_step = int(a.progress.get("step", 0))
    b2 = local_swarm.start_node("b", run, steps=12, wait_peers=1, extra=FAST)
    assert b2.wait(240) == 0, b2.tail()
    again = b2.summary
    assert again is not None
    ck = again["checkpoint"]
    assert ck["resumed"] == str(newest.path)
    assert ck["resumed_step"] == first["final_step"]
    assert again["start_step"] >= first["final_step"]
    assert again["start_step"] >= a_step - 2 * RUN["H"], (a_step, again["start_step"])
    # a fragment the swarm moved past meanwhile is fetched; the others were kept
    assert set(ck["fetched"]) <= {0, 1}
    assert "resumed ckpt-" in b2.stderr()

    a.proc.send_signal(signal.SIGINT)
    assert a.wait(60) == 0, a.tail()


def test_a_torn_newest_checkpoint_is_passed_over(
    local_swarm: Any, wait_until: Any, tmp_path: Path
) -> None:
    run = local_swarm.write_manifest("torn", local_swarm.manifest("torn-test", **RUN))
    local_swarm.start_bootstrap()
    a = local_swarm.start_node("a", run, steps=0, wait_peers=1, extra=FAST)
    b = local_swarm.start_node("b", run, steps=0, wait_peers=1, extra=FAST)
    wait_until(lambda: _applied_rounds(b) >= 1, 240, "b's first round")
    peer_b = b.progress["peer_id"]
    wait_until(lambda: len(_store_of(tmp_path, peer_b).list()) >= 1, 60, "a checkpoint of b")
    b.proc.send_signal(signal.SIGINT)
    assert b.wait(60) == 0, b.tail()
    store = _store_of(tmp_path, peer_b)
    infos = store.list()
    assert len(infos) >= 2, infos  # a periodic one and the last one
    newest, before = infos[-1], infos[-2]
    # tear the newest: a byte of its tensors flipped, as a crash or a bad disk would
    tensors = newest.path / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensors.write_bytes(bytes(data))
    assert newest.problem() is not None

    b2 = local_swarm.start_node("b", run, steps=6, wait_peers=1, extra=FAST)
    assert b2.wait(240) == 0, b2.tail()
    assert b2.summary is not None
    assert b2.summary["checkpoint"]["resumed"] == str(before.path)
    assert f"checkpoint {newest.path.name} skipped" in b2.stderr()
    a.proc.send_signal(signal.SIGINT)
    assert a.wait(60) == 0, a.tail()


def test_periodic_checkpoints_through_a_real_bridge(tmp_path: Path, wait_until: Any) -> None:
    """NodeCheckpoints with a real network process (the bridge's reference worker): a
    save begins only when due and quiet, its engine part is the network process's engine
    after its rounds, and the last save at stop waits for its answer."""
    import numpy as np
    import torch

    from atoll.node.net.bridge import NetworkBridge, SharedFragments
    from atoll.node.snapshot import NodeCheckpoints, load_engine_part
    from atoll.protocol.engine import EngineConfig

    sizes = [500, 77]
    shared = SharedFragments.create(sizes)
    try:
        for p, n in enumerate(sizes):
            shared.global_(p)[:] = np.linspace(-1, 1, n, dtype=np.float32)
        config = EngineConfig(H=4, tau=0, alpha=0.0, codec="e3m0")
        worker = "atoll.node.net.bridge:local_engine_worker"
        with NetworkBridge(shared, worker, {"config": config, "seed": 3}) as bridge:
            for p in range(len(sizes)):
                shared.local(p)[:] = shared.global_(p) + 0.25
                bridge.start_sync(p, 0, 100 * (p + 1))
                outcome = bridge.wait(p, 30)
                assert outcome is not None and outcome.applied, outcome
            model = torch.nn.Linear(4, 3)
            optimizer = torch.optim.AdamW(model.parameters())
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            now = [0.0]
            ckpts = NodeCheckpoints(
                CheckpointStore(tmp_path / "ckpt"),
                every_s=5.0,
                identity={"run_id": "r" * 64, "peer_id": "p"},
                clock=lambda: now[0],
            )

            def poll(quiet: bool = True) -> None:
                ckpts.poll(
                    bridge, model, optimizer, step=7, tokens=300, quiet=quiet, meta=lambda: {}
                )

            poll()
            assert not ckpts.stats.stalls  # not due yet
            now[0] = 6.0
            poll(quiet=False)
            assert not ckpts.stats.stalls  # due, but a sync is in flight
            poll()
            assert len(ckpts.stats.stalls) == 1

            def saved() -> bool:
                poll()
                return ckpts.stats.saved == 1

            wait_until(saved, 30, "the periodic checkpoint", interval_s=0.05)
            last = ckpts.final(bridge, model, optimizer, step=8, tokens=310, meta={}, timeout_s=30)
            assert last is not None and ckpts.stats.saved == 2, ckpts.stats
            state, _, _ = load_engine_part(last)
            for p in range(len(sizes)):
                got = state["fragments"][p]
                assert got["version"] == 1
                np.testing.assert_array_equal(got["global"], shared.global_(p))
            newest = CheckpointStore(tmp_path / "ckpt", read_only=True).latest()
            assert newest is not None and newest.meta["step"] == 8
            assert newest.meta["versions"] == [1, 1]
            assert torch.equal(
                torch.from_numpy(newest.tensors["model/weight"]), model.weight.detach()
            )
    finally:
        shared.close()
        shared.unlink()


def _stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.timeout(900)
def test_a_node_resumed_at_a_wrong_step_is_caught_before_it_contributes(
    local_swarm: Any, wait_until: Any, tmp_path: Path
) -> None:
    """A checkpoint whose step is wrong (its learning-rate schedule, fragment phase and
    data position are not the swarm's, though its fragments are), and off by half a
    period besides: the two peers sync each fragment at different times and never meet
    at a slot. One refuses the other's request as out of step from outside the slot, the
    refused one moves to the other's step, and only then do they apply rounds together.
    Which one moves is the step order's choice: with two peers there is no majority to
    say which step is right."""
    # long enough a run for b to resume far past a and still train
    run = local_swarm.write_manifest(
        "wrong", local_swarm.manifest("wrong-step", **{**RUN, "total_steps": 1200})
    )
    local_swarm.start_bootstrap()
    a = local_swarm.start_node("a", run, steps=0, wait_peers=1, extra=FAST)
    b = local_swarm.start_node("b", run, steps=0, wait_peers=1, extra=FAST)
    wait_until(lambda: _applied_rounds(b) >= 2, 240, "b's rounds")
    peer_b = b.progress["peer_id"]
    b.proc.send_signal(signal.SIGINT)
    assert b.wait(60) == 0, b.tail()
    assert b.summary is not None
    stopped_at = b.summary["final_step"]
    # the same state, restored at a wrong step: the last checkpoint saved again with it
    folder = _store_of(tmp_path, peer_b).folder
    store = CheckpointStore(folder)
    newest = store.latest()
    assert newest is not None
    # twenty periods and a half past a's step: each fragment's sync falls about half a
    # period away from a's. a trains on alone while b restarts (a hogged CI run saw it
    # move some 70 steps): the margin keeps b further from a than the steps groupmates
    # may differ by (4 periods) plus one, where only an out-of-step refusal brings two
    # peers that never meet at a slot together
    wrong = max(stopped_at, a.progress.get("step", 0)) + 246
    store.save(newest.tensors, {**newest.meta, "step": wrong})

    # b trains until stopped: once the two are in step, realigning and the next syncs'
    # matchmaking can take more than a fixed number of steps on a busy machine
    b2 = local_swarm.start_node("b", run, steps=0, wait_peers=1, extra=FAST)

    def both() -> str:
        codes = f"exit codes: a {a.proc.poll()}, b {b2.proc.poll()}"
        return f"{codes}\n--- a:\n{a.tail(40)}\n--- b:\n{b2.tail(40)}"

    def b_applied_after_the_catch() -> bool:
        assert b2.proc.poll() is None and a.proc.poll() is None, both()
        return "out of step" in b2.stderr() + a.stderr() and ": applied;" in b2.stderr()

    wait_until(b_applied_after_the_catch, 480, both)
    for node in (b2, a):
        node.proc.send_signal(signal.SIGINT)
    assert b2.wait(60) == 0, b2.tail()
    assert a.wait(60) == 0, a.tail()
    assert b2.summary is not None and a.summary is not None, b2.tail()
    assert b2.summary["checkpoint"]["resumed_step"] == wrong
    assert b2.summary["realigned"] + a.summary["realigned"] >= 1, b2.tail(60)
    b_log = b2.stderr().splitlines()
    caught = min(
        _stamp(line)
        for line in b_log + a.stderr().splitlines()
        if "out of step" in line and line[:4].isdigit()
    )
    applied = [_stamp(line) for line in b_log if ": applied;" in line]
    assert applied, "b applied no round once the two were in step"
    assert min(applied) > caught, "b contributed to a round before the two were in step"
