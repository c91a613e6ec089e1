"""The local checkpoint store on real files: round trips, pruning, torn checkpoints,
refused saves and sequence numbers across re-opening."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from atoll.node.checkpoint import (
    FORMAT_VERSION,
    META_FILE,
    TENSORS_FILE,
    CheckpointError,
    CheckpointStore,
    Loaded,
)
from atoll.protocol.errors import ConfigError

LOGGER = "atoll.node.checkpoint"


def _state(step: int) -> dict[str, np.ndarray]:
    """A small trainer state whose values depend on the step."""
    return {
        "block.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4) * (step + 1),
        "step_count": np.array([step, step * 10], dtype=np.int64),
    }


def _save(store: CheckpointStore, step: int) -> Path:
    return store.save(_state(step), {"step": step, "lr": 0.5 / (step + 1)})


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _assert_step(loaded: Loaded | None, step: int) -> None:
    assert loaded is not None
    expected = _state(step)
    assert loaded.tensors.keys() == expected.keys()
    for name, value in expected.items():
        assert loaded.tensors[name].dtype == value.dtype
        np.testing.assert_array_equal(loaded.tensors[name], value)
    assert loaded.meta == {"step": step, "lr": 0.5 / (step + 1)}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- round trip


def test_round_trip_of_numpy_and_torch_tensors_and_meta(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6).reshape(2, 3))  # requires_grad
    half = torch.tensor([1.5, -2.25, 3.0e38, 1.0e-10], dtype=torch.bfloat16)
    tensors: dict[str, npt.NDArray[Any] | torch.Tensor] = {
        "np.f32": np.array([[1.25, -2.5], [3.0e-8, 4.0e8]], dtype=np.float32),
        "np.i64": np.array([0, -1, 2**62, -(2**63)], dtype=np.int64),
        "torch.f32": weight,
        "torch.i64": torch.tensor([7, -8, 2**40], dtype=torch.int64),
        "torch.bf16": half,
        "torch.bool": torch.tensor([True, False, True]),
    }
    meta: dict[str, Any] = {"step": 1200, "loss": 2.75, "run": "r1", "ok": True, "none": None}
    meta |= {"shape": (2, 3), "nested": {"lr": [0.1, 0.01], "names": ["a", "é"]}}
    path = store.save(tensors, meta)

    assert path == tmp_path / "ckpt" / "ckpt-000001"
    assert _names(path) == [META_FILE, TENSORS_FILE]
    loaded = store.latest()
    assert loaded is not None
    assert (loaded.path, loaded.sequence) == (path, 1)
    t = loaded.tensors
    assert {k: str(v.dtype) for k, v in t.items()} == {
        "np.f32": "float32",
        "np.i64": "int64",
        "torch.f32": "float32",
        "torch.i64": "int64",
        "torch.bf16": "float32",  # widened, exactly
        "torch.bool": "bool",
    }
    np.testing.assert_array_equal(t["np.f32"], tensors["np.f32"])
    np.testing.assert_array_equal(t["np.i64"], [0, -1, 2**62, -(2**63)])
    np.testing.assert_array_equal(t["torch.f32"], weight.detach().numpy())
    assert t["torch.f32"].shape == (2, 3)
    np.testing.assert_array_equal(t["torch.i64"], [7, -8, 2**40])
    np.testing.assert_array_equal(t["torch.bf16"], half.float().numpy())
    np.testing.assert_array_equal(t["torch.bool"], [True, False, True])
    # JSON gives tuples back as lists
    assert loaded.meta == {**meta, "shape": [2, 3]}
    assert loaded.meta["nested"]["names"] == ["a", "é"]


def test_meta_json_records_format_and_digests(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = _save(store, 3)
    record = json.loads((path / META_FILE).read_text())
    assert record["format"] == FORMAT_VERSION
    assert record["sequence"] == 1
    assert record["meta"] == {"step": 3, "lr": 0.125}
    tensors_bytes = (path / TENSORS_FILE).read_bytes()
    assert record["tensors_sha256"] == hashlib.sha256(tensors_bytes).hexdigest()
    assert record["tensors_bytes"] == len(tensors_bytes)
    assert record["tensors_count"] == 2
    rest = {k: v for k, v in record.items() if k != "meta_sha256"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert record["meta_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()


def test_awkward_numpy_layouts_are_stored_by_value(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    tensors = {
        "transposed": base.T,  # not contiguous
        "strided": base[:, ::2],
        "big_endian": np.array([1, 258, -3], dtype=">i4"),
        "scalar": np.array(2.5, dtype=np.float16),
        "empty": np.zeros((0, 5), dtype=np.uint16),
    }
    store.save(tensors, {})
    loaded = store.latest()
    assert loaded is not None
    for name, value in tensors.items():
        got = loaded.tensors[name]
        assert got.shape == value.shape, name
        assert got.dtype == value.dtype.newbyteorder("="), name
        np.testing.assert_array_equal(got, value)
    np.testing.assert_array_equal(loaded.tensors["transposed"][0], [0.0, 4.0, 8.0])
    np.testing.assert_array_equal(loaded.tensors["big_endian"], [1, 258, -3])


def test_save_time_is_measured(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.last_save_s is None
    _save(store, 0)
    first = store.last_save_s
    assert first is not None and 0.0 < first < 60.0
    _save(store, 1)
    assert store.last_save_s is not None and store.last_save_s != first


# ---- pruning and sequence numbers


def test_only_the_last_keep_checkpoints_remain(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    paths = [_save(store, step) for step in range(5)]
    assert [p.name for p in paths] == [f"ckpt-00000{i}" for i in range(1, 6)]
    assert _names(tmp_path) == ["ckpt-000004", "ckpt-000005"]
    assert [(c.sequence, c.path) for c in store.list()] == [(4, paths[3]), (5, paths[4])]
    _assert_step(store.latest(), 4)


def test_keep_one_never_removes_the_checkpoint_just_written(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    _save(store, 0)
    _save(store, 1)
    assert _names(tmp_path) == ["ckpt-000002"]
    _assert_step(store.latest(), 1)


def test_broken_checkpoints_do_not_count_towards_keep(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    _save(store, 0)
    second = _save(store, 1)
    (second / META_FILE).unlink()
    _save(store, 2)
    # two valid ones (3 and 1) are kept; the broken 2 between them stays too
    assert _names(tmp_path) == ["ckpt-000001", "ckpt-000002", "ckpt-000003"]
    _save(store, 3)
    assert _names(tmp_path) == ["ckpt-000003", "ckpt-000004"]


def test_sequence_numbers_continue_after_reopening(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in range(3):
        _save(store, step)
    reopened = CheckpointStore(tmp_path, keep=2)
    _assert_step(reopened.latest(), 2)
    assert _save(reopened, 3).name == "ckpt-000004"
    assert [c.sequence for c in reopened.list()] == [3, 4]
    newest = reopened.latest()
    assert newest is not None and newest.sequence == 4


def test_empty_or_missing_folder_has_no_checkpoint(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path).latest() is None
    assert CheckpointStore(tmp_path).list() == []
    missing = tmp_path / "not" / "yet"
    reader = CheckpointStore(missing, read_only=True)
    assert reader.latest() is None
    assert reader.list() == []
    assert not missing.exists()
    CheckpointStore(missing)  # a writing store creates it
    assert missing.is_dir()
    (missing / "notes.txt").write_text("unrelated")
    (missing / "ckpt-12").mkdir()  # not a checkpoint's name
    assert CheckpointStore(missing).latest() is None
    assert _save(CheckpointStore(missing), 0).name == "ckpt-000001"


# ---- torn and corrupted checkpoints


def _truncate_tensors(path: Path) -> None:
    data = (path / TENSORS_FILE).read_bytes()
    (path / TENSORS_FILE).write_bytes(data[: len(data) // 2])


def _flip_tensor_byte(path: Path) -> None:
    data = bytearray((path / TENSORS_FILE).read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's values; the size stays
    (path / TENSORS_FILE).write_bytes(bytes(data))


def _flip_meta_byte(path: Path) -> None:
    text = (path / META_FILE).read_text()
    assert text.count('"step": 1') == 1
    (path / META_FILE).write_text(text.replace('"step": 1', '"step": 9'))  # still valid JSON


def _delete_meta(path: Path) -> None:
    (path / META_FILE).unlink()


def _delete_tensors(path: Path) -> None:
    (path / TENSORS_FILE).unlink()


def _future_format(path: Path) -> None:
    record = json.loads((path / META_FILE).read_text())
    record["format"] = FORMAT_VERSION + 1
    (path / META_FILE).write_text(json.dumps(record))


def _garbled_meta(path: Path) -> None:
    (path / META_FILE).write_bytes(b'{"format": 1, "seq')


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated tensors": (_truncate_tensors, "truncated"),
    "flipped tensor byte": (_flip_tensor_byte, "does not match its SHA-256 digest"),
    "flipped meta byte": (_flip_meta_byte, "meta_sha256"),
    "deleted meta": (_delete_meta, "meta.json is missing"),
    "deleted tensors": (_delete_tensors, "tensors.safetensors is missing"),
    "future format": (_future_format, f"format version {FORMAT_VERSION + 1}"),
    "garbled meta": (_garbled_meta, "not valid JSON"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 0)
    newest = _save(store, 1)
    harm, why = DAMAGE[damage]
    harm(newest)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded = store.latest()
    _assert_step(loaded, 0)
    assert loaded is not None and loaded.sequence == 1
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "ckpt-000002" in warnings[0] and why in warnings[0]
    # the listing says the same, lazily
    problems = {c.sequence: c.problem() for c in store.list()}
    assert problems[1] is None
    assert problems[2] is not None and why in problems[2]
    # the next save takes the next number and does not load the broken one either
    assert _save(store, 2).name == "ckpt-000003"
    _assert_step(store.latest(), 2)


def test_a_checkpoint_under_another_sequence_number_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 0)
    second = _save(store, 1)
    second.rename(tmp_path / "ckpt-000007")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _assert_step(store.latest(), 0)
    assert _warnings(caplog) == [
        "checkpoint ckpt-000007 skipped: meta.json says sequence 2, the folder's name 7"
    ]


def test_all_broken_gives_none_with_one_warning_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    for step in range(2):
        _truncate_tensors(_save(store, step))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.latest() is None
    warnings = _warnings(caplog)
    assert len(warnings) == 2
    assert "ckpt-000002" in warnings[0] and "ckpt-000001" in warnings[1]


def test_a_save_stopped_mid_write_is_ignored_then_cleaned_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    first = _save(store, 0)
    # what a process killed while writing checkpoint 2 leaves behind: its hidden temporary
    # folder with a partial tensors file and no meta.json yet
    crashed = tmp_path / ".ckpt-000002.tmp-0123abcd"
    crashed.mkdir()
    partial = (first / TENSORS_FILE).read_bytes()
    (crashed / TENSORS_FILE).write_bytes(partial[: len(partial) // 3])
    # and one killed while removing an old checkpoint
    removing = tmp_path / ".ckpt-000000.del-89abcdef"
    shutil.copytree(first, removing)

    reopened = CheckpointStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded = reopened.latest()
    _assert_step(loaded, 0)
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert ".ckpt-000002.tmp-0123abcd" in warnings[0] and "never finished" in warnings[0]
    assert [c.sequence for c in reopened.list()] == [1]

    assert _save(reopened, 1).name == "ckpt-000002"
    assert _names(tmp_path) == ["ckpt-000001", "ckpt-000002"]
    _assert_step(reopened.latest(), 1)


# ---- refused input changes nothing


class _Twice(Mapping[str, Any]):
    """A mapping whose items name one tensor twice."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self._pairs = pairs

    def __getitem__(self, key: str) -> Any:
        return dict(self._pairs)[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)


def _cyclic() -> dict[str, Any]:
    meta: dict[str, Any] = {"a": []}
    meta["a"].append(meta)
    return meta


BAD_META: dict[str, tuple[Any, str]] = {
    "object": ({"step": 1, "model": object()}, "meta['model'] is object"),
    "nan": ({"loss": float("nan")}, "meta['loss'] is nan"),
    "infinity": ({"x": [1.0, float("inf")]}, "meta['x'][1] is inf"),
    "numpy scalar": ({"loss": np.float32(1.5)}, ".item()"),
    "int key": ({"lrs": {1: 0.1}}, "has the key 1"),
    "cycle": (_cyclic(), "contains itself"),
    "not a mapping": ([("step", 1)], "meta must be a mapping"),
}

BAD_TENSORS: dict[str, tuple[Any, str]] = {
    "list": ({"w": [1.0, 2.0]}, "'w' is list"),
    "strings": ({"w": np.array(["a", "b"])}, "dtype <U1"),
    "objects": ({"w": np.array([object()])}, "dtype object"),
    "complex": ({"w": np.zeros(2, dtype=np.complex64)}, "dtype complex64"),
    "torch complex": ({"w": torch.zeros(2, dtype=torch.complex64)}, "complex64"),
    "off the cpu": ({"w": torch.zeros(2, device="meta")}, "is on meta"),
    "sparse": ({"w": torch.zeros(3, 3).to_sparse()}, "not a dense tensor"),
    "empty name": ({"": np.zeros(2)}, "not allowed"),
    "reserved name": ({"__metadata__": np.zeros(2)}, "not allowed"),
    "unprintable name": ({"w\n": np.zeros(2)}, "not allowed"),
    "int name": ({3: np.zeros(2)}, "tensor name 3 is int"),
    "duplicate name": (_Twice([("w", np.zeros(2)), ("w", np.ones(2))]), "appears twice"),
    "not a mapping": ([np.zeros(2)], "tensors must be a mapping"),
}


def _assert_refused_and_unchanged(tmp_path: Path, tensors: Any, meta: Any, message: str) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 0)
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        store.save(tensors, meta)
    assert message in str(refused.value)
    assert isinstance(refused.value, ConfigError) and isinstance(refused.value, ValueError)
    assert _snapshot(tmp_path) == before
    assert _names(tmp_path) == ["ckpt-000001"]  # no temporary folder either
    _assert_step(store.latest(), 0)
    assert _save(store, 1).name == "ckpt-000002"  # the refusal used no number


@pytest.mark.parametrize("case", BAD_META)
def test_meta_that_is_not_json_is_refused_and_loses_nothing(tmp_path: Path, case: str) -> None:
    meta, message = BAD_META[case]
    _assert_refused_and_unchanged(tmp_path, _state(5), meta, message)


@pytest.mark.parametrize("case", BAD_TENSORS)
def test_tensors_that_are_not_numeric_arrays_are_refused(tmp_path: Path, case: str) -> None:
    tensors, message = BAD_TENSORS[case]
    _assert_refused_and_unchanged(tmp_path, tensors, {"step": 5}, message)


def test_a_bad_tensor_after_good_ones_writes_nothing(tmp_path: Path) -> None:
    tensors = {**_state(5), "zz": np.array([b"x"])}
    _assert_refused_and_unchanged(tmp_path, tensors, {"step": 5}, "'zz' has dtype |S1")


# ---- the folder


def test_a_folder_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.write_text("not a folder")
    with pytest.raises(CheckpointError, match="is a file"):
        CheckpointStore(path)
    with pytest.raises(CheckpointError, match="is a file"):
        CheckpointStore(path, read_only=True)
    with pytest.raises(CheckpointError, match="a part of its path is a file"):
        CheckpointStore(path / "below")
    assert path.read_text() == "not a folder"


def test_a_non_writable_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("this user writes into read-only folders (root)")
        with pytest.raises(CheckpointError, match="is not writable"):
            CheckpointStore(folder)
        with pytest.raises(CheckpointError, match="cannot be created"):
            CheckpointStore(folder / "inner")
        assert CheckpointStore(folder, read_only=True).latest() is None
    finally:
        folder.chmod(0o755)


def test_a_read_only_store_refuses_to_save(tmp_path: Path) -> None:
    _save(CheckpointStore(tmp_path), 0)
    reader = CheckpointStore(tmp_path, read_only=True)
    with pytest.raises(CheckpointError, match="read-only"):
        _save(reader, 1)
    _assert_step(reader.latest(), 0)
    assert _names(tmp_path) == ["ckpt-000001"]


@pytest.mark.parametrize("keep", [0, -1, True, 2.0])
def test_keep_must_be_a_positive_int(tmp_path: Path, keep: Any) -> None:
    with pytest.raises(CheckpointError, match="keep must be"):
        CheckpointStore(tmp_path, keep=keep)
