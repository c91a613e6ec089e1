"""Local checkpoints of a training node, so that a restart resumes where it stopped.

A :class:`CheckpointStore` owns one folder. Each :meth:`~CheckpointStore.save` adds a
subfolder named by a sequence number that only grows (``ckpt-000042``), holding two files:

- ``tensors.safetensors``: the named arrays, in the safetensors format;
- ``meta.json``: the caller's metadata under ``"meta"``, plus the store's own record: the
  format version, the sequence number, the save time, the tensors file's size, tensor
  count and SHA-256 digest, and ``meta_sha256``, the SHA-256 of the canonical JSON form
  (sorted keys, no spaces, ASCII) of every other field of the file.

A save is atomic: both files are written into a hidden temporary folder next to the final
one and flushed to disk, the folder is renamed to its final name and the parent folder is
flushed too. A process that stops mid-save therefore leaves a temporary folder, never a
half-written checkpoint under a final name. After the rename the store keeps the newest
``keep`` checkpoints that pass verification, removes older ones and any temporary folder
left by an earlier crash. Every argument is checked before anything is written, so a
refused save changes nothing on disk.

:meth:`~CheckpointStore.latest` returns the newest checkpoint that verifies (files
present, record parses, known format version, both digests match); each newer one that
does not is skipped with one WARNING line saying which and why.

What a load returns: every tensor as a numpy array of the dtype it was stored with. numpy
arrays are stored as they are (bool, signed and unsigned integers, float16/32/64; byte
order normalised to little-endian). CPU torch tensors are stored through their numpy view,
so they come back as numpy arrays of the matching dtype, except bfloat16, which numpy
lacks: it is widened to float32, which is exact. The metadata comes back as parsed JSON
(tuples become lists).

The store does no I/O in the background and imports nothing of atoll's network side; a
trainer calls :meth:`~CheckpointStore.save` from a worker thread with a snapshot (copies)
of its state, and reads :attr:`~CheckpointStore.last_save_s` to report how long it took.
One store object per folder: calls on it are serialised by a lock, but two processes
writing the same folder are not supported.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file, save_file

from atoll.protocol.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "TENSORS_FILE",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "Loaded",
    "load_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""The layout of ``meta.json`` this module writes; a checkpoint of another is skipped."""
KNOWN_FORMATS = frozenset({FORMAT_VERSION})
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"

_PREFIX = "ckpt-"
_FINAL = re.compile(r"ckpt-(\d{6,})")
# a write in progress (or stopped by a crash) and a checkpoint being removed
_HIDDEN = re.compile(r"\.ckpt-(\d{6,})\.(tmp|del)-[0-9a-f]+")
_NUMERIC_KINDS = "biuf"  # bool, signed and unsigned integers, floats
_RESERVED_NAME = "__metadata__"  # the safetensors header's own entry
_RECORD_FIELDS = {
    "format": int,
    "sequence": int,
    "saved_at": float,
    "tensors_bytes": int,
    "tensors_count": int,
    "tensors_sha256": str,
    "meta_sha256": str,
    "meta": dict,
}

TensorLike: TypeAlias = "npt.NDArray[Any] | torch.Tensor"


class CheckpointError(ConfigError):
    """The checkpoint store refused its folder or the arguments of a save.

    Nothing was written; an existing checkpoint is untouched.
    """


@dataclass(frozen=True, slots=True)
class Loaded:
    """A checkpoint read back and verified."""

    path: Path
    sequence: int
    tensors: dict[str, npt.NDArray[Any]]
    """each stored tensor by name, as a writable numpy array (see the module's notes on
    dtypes)"""
    meta: dict[str, Any]
    """the caller's metadata as it was saved, parsed back from JSON"""
    saved_at: float
    """when the save wrote it, in seconds since the epoch"""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A checkpoint folder found on disk; listing one reads none of its files."""

    sequence: int
    path: Path

    def problem(self) -> str | None:
        """Why this checkpoint would not load, or None when it verifies.

        Reads ``meta.json`` and hashes the whole tensors file; it does not parse the
        tensors (a tensors file whose digest matches is the one that was written).
        """
        record = _read_record(self.path, self.sequence)
        if isinstance(record, str):
            return record
        return _check_tensors_digest(self.path, record)


def _folder_name(sequence: int) -> str:
    return f"{_PREFIX}{sequence:06d}"


def _canonical(value: Mapping[str, Any]) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _record_digest(record: Mapping[str, Any]) -> str:
    return hashlib.sha256(
        _canonical({k: v for k, v in record.items() if k != "meta_sha256"})
    ).hexdigest()


def _file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _read_record(path: Path, sequence: int) -> dict[str, Any] | str:
    """The parsed ``meta.json`` of a checkpoint folder, or why it is not usable."""
    meta_path = path / META_FILE
    try:
        text = meta_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"{META_FILE} is missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"{META_FILE} cannot be read ({e})"
    try:
        record = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as e:
        return f"{META_FILE} is not valid JSON ({e})"
    if not isinstance(record, dict):
        return f"{META_FILE} does not hold a JSON object"
    version = record.get("format")
    if type(version) is not int or version not in KNOWN_FORMATS:
        known = ", ".join(map(str, sorted(KNOWN_FORMATS)))
        return f"format version {version!r} is not one this atoll reads ({known})"
    for name, kind in _RECORD_FIELDS.items():
        value = record.get(name)
        ok = isinstance(value, (int, float)) if kind is float else type(value) is kind
        if not ok or isinstance(value, bool):
            return f"{META_FILE}: field {name!r} is missing or not {kind.__name__}"
    if record["meta_sha256"] != _record_digest(record):
        return f"{META_FILE} does not match its own SHA-256 digest (meta_sha256)"
    if record["sequence"] != sequence:
        return f"{META_FILE} says sequence {record['sequence']}, the folder's name {sequence}"
    return record


def _check_tensors_digest(path: Path, record: Mapping[str, Any]) -> str | None:
    tensors_path = path / TENSORS_FILE
    try:
        size = tensors_path.stat().st_size
        if size != record["tensors_bytes"]:
            return (
                f"{TENSORS_FILE} is {size} bytes, {META_FILE} says {record['tensors_bytes']}"
                " (truncated or replaced)"
            )
        digest = _file_sha256(tensors_path)
    except FileNotFoundError:
        return f"{TENSORS_FILE} is missing"
    except OSError as e:
        return f"{TENSORS_FILE} cannot be read ({e})"
    if digest != record["tensors_sha256"]:
        return f"{TENSORS_FILE} does not match its SHA-256 digest in {META_FILE}"
    return None


def _load(info: CheckpointInfo) -> Loaded | str:
    """The verified checkpoint of ``info``, or why it is not usable."""
    record = _read_record(info.path, info.sequence)
    if isinstance(record, str):
        return record
    problem = _check_tensors_digest(info.path, record)
    if problem is not None:
        return problem
    try:
        tensors = load_file(info.path / TENSORS_FILE)
    except Exception as e:  # safetensors' own error class differs between its versions
        return f"{TENSORS_FILE} does not parse ({e})"
    if len(tensors) != record["tensors_count"]:
        return (
            f"{TENSORS_FILE} holds {len(tensors)} tensors, {META_FILE} says "
            f"{record['tensors_count']}"
        )
    return Loaded(info.path, info.sequence, tensors, record["meta"], float(record["saved_at"]))


def load_checkpoint(folder: Path | str) -> Loaded:
    """The checkpoint in ``folder`` (one ``ckpt-NNNNNN`` folder a store wrote), verified;
    :class:`CheckpointError` saying why when it does not verify."""
    path = Path(folder)
    m = _FINAL.fullmatch(path.name)
    if m is None:
        raise CheckpointError(f"{path} is not a checkpoint folder (ckpt-NNNNNN)")
    loaded = _load(CheckpointInfo(int(m.group(1)), path))
    if isinstance(loaded, str):
        raise CheckpointError(f"checkpoint {path} does not verify: {loaded}")
    return loaded


def _as_array(name: str, value: object) -> npt.NDArray[Any]:
    """``value`` as a C-contiguous little-endian numeric numpy array, or CheckpointError."""
    torch_module = sys.modules.get("torch")  # a caller passing tensors has imported it
    if torch_module is not None and isinstance(value, torch_module.Tensor):
        if value.device.type != "cpu":
            raise CheckpointError(
                f"tensor {name!r} is on {value.device}; save a CPU copy of it instead"
            )
        if value.layout != torch_module.strided:
            raise CheckpointError(f"tensor {name!r} is {value.layout}, not a dense tensor")
        t = value.detach()
        if t.dtype == torch_module.bfloat16:
            t = t.float()  # numpy has no bfloat16; float32 holds every bfloat16 exactly
        try:
            value = t.numpy()
        except (TypeError, RuntimeError) as e:
            raise CheckpointError(
                f"tensor {name!r} of dtype {t.dtype} cannot be stored: {e}"
            ) from None
    if not isinstance(value, np.ndarray):
        raise CheckpointError(
            f"tensor {name!r} is {type(value).__name__}, not a numpy array or torch tensor"
        )
    if value.dtype.kind not in _NUMERIC_KINDS:
        raise CheckpointError(
            f"tensor {name!r} has dtype {value.dtype}; only bool, integer and float arrays "
            "are stored"
        )
    # astype, not ascontiguousarray, which makes a 0-d array 1-d
    return value.astype(value.dtype.newbyteorder("<"), order="C", copy=False)


def _check_name(name: object, seen: set[str]) -> str:
    if not isinstance(name, str):
        raise CheckpointError(f"tensor name {name!r} is {type(name).__name__}, not str")
    if not name or not name.isprintable() or name == _RESERVED_NAME:
        raise CheckpointError(
            f"tensor name {name!r} is not allowed (empty, unprintable or {_RESERVED_NAME!r})"
        )
    if name in seen:
        raise CheckpointError(f"tensor name {name!r} appears twice")
    seen.add(name)
    return name


def _plain_json(value: object, where: str, open_ids: set[int]) -> Any:
    """``value`` as plain JSON data (dicts, lists, str, finite numbers, bools, None), or
    CheckpointError saying where it is not."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointError(f"{where} is {value}, which JSON cannot hold")
        return value
    if isinstance(value, (Mapping, list, tuple)):
        if id(value) in open_ids:
            raise CheckpointError(f"{where} contains itself")
        open_ids.add(id(value))
        out: Any
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"{where} has the key {k!r}; JSON keys are str")
                out[k] = _plain_json(v, f"{where}[{k!r}]", open_ids)
        else:
            out = [_plain_json(v, f"{where}[{i}]", open_ids) for i, v in enumerate(value)]
        open_ids.discard(id(value))
        return out
    hint = " (convert numpy scalars with .item())" if isinstance(value, np.generic) else ""
    raise CheckpointError(f"{where} is {type(value).__name__}, which JSON cannot hold{hint}")


class CheckpointStore:
    """The checkpoints of one node in ``folder``, keeping the newest ``keep`` valid ones.

    The folder is created when missing. A store opened with ``read_only=True`` neither
    creates nor checks it for writing, and refuses :meth:`save` (for listing a folder that
    another process writes).
    """

    def __init__(self, folder: Path | str, keep: int = 3, *, read_only: bool = False) -> None:
        if type(keep) is not int or keep < 1:
            raise CheckpointError(f"keep must be an int >= 1, not {keep!r}")
        self.folder = Path(folder)
        self.keep = keep
        self.read_only = read_only
        self.last_save_s: float | None = None
        """seconds the latest :meth:`save` of this object took, from its call to its
        return (None before the first)"""
        self._lock = threading.Lock()
        # verification results of older checkpoints, for pruning: name -> (stat key, ok)
        self._verified: dict[str, tuple[tuple[int, ...], bool]] = {}
        if self.folder.exists() and not self.folder.is_dir():
            raise CheckpointError(f"checkpoint folder {self.folder} is a file, not a folder")
        if not read_only:
            self._check_writable()

    def _check_writable(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise CheckpointError(
                f"checkpoint folder {self.folder} cannot be created: a part of its path is a file"
            ) from None
        except OSError as e:
            raise CheckpointError(
                f"checkpoint folder {self.folder} cannot be created: {e.strerror or e}"
            ) from None
        if not os.access(self.folder, os.W_OK | os.X_OK):
            raise CheckpointError(f"checkpoint folder {self.folder} is not writable")

    def _scan(self) -> tuple[builtins.list[CheckpointInfo], builtins.list[tuple[Path, str]]]:
        """Checkpoints by ascending sequence, and hidden folders with their kind."""
        finals: builtins.list[CheckpointInfo] = []
        hidden: builtins.list[tuple[Path, str]] = []
        try:
            entries = builtins.list(os.scandir(self.folder))
        except FileNotFoundError:
            return finals, hidden
        except NotADirectoryError:
            raise CheckpointError(
                f"checkpoint folder {self.folder} is a file, not a folder"
            ) from None
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if m := _FINAL.fullmatch(entry.name):
                sequence = int(m.group(1))
                if entry.name == _folder_name(sequence):  # one name per sequence
                    finals.append(CheckpointInfo(sequence, Path(entry.path)))
            elif m := _HIDDEN.fullmatch(entry.name):
                hidden.append((Path(entry.path), m.group(2)))
        finals.sort(key=lambda c: c.sequence)
        return finals, hidden

    def list(self) -> builtins.list[CheckpointInfo]:
        """The checkpoints in the folder, oldest first; valid or not
        (:meth:`CheckpointInfo.problem` says)."""
        return self._scan()[0]

    def latest(self) -> Loaded | None:
        """The newest checkpoint that verifies, or None when there is none.

        Each newer checkpoint that fails verification, and each temporary folder of a save
        that never finished, is reported in one WARNING line and passed over.
        """
        with self._lock:
            finals, hidden = self._scan()
            for path, kind in hidden:
                if kind == "tmp":
                    log.warning(
                        "checkpoint write %s was never finished (stopped mid-save); ignored",
                        path.name,
                    )
            for info in reversed(finals):
                loaded = _load(info)
                if isinstance(loaded, Loaded):
                    return loaded
                log.warning("checkpoint %s skipped: %s", info.path.name, loaded)
            return None

    def save(self, tensors: Mapping[str, TensorLike], meta: Mapping[str, Any]) -> Path:
        """Write one checkpoint atomically and return its folder.

        ``tensors`` maps names to numpy arrays or CPU torch tensors of bool, integer or
        float dtype; ``meta`` must be plain JSON (str keys, finite numbers). Arguments are
        checked before anything is written, and a refusal raises :class:`CheckpointError`
        with the store unchanged; a failure of the disk itself (full, gone) raises its
        OSError after the temporary folder is removed. Then the checkpoints beyond the
        newest ``keep`` valid ones are removed. The arrays are read while this runs, so
        hand it copies the trainer does not change meanwhile.
        """
        started = time.perf_counter()
        if self.read_only:
            raise CheckpointError(f"checkpoint store {self.folder} was opened read-only")
        if not isinstance(tensors, Mapping):
            raise CheckpointError(f"tensors must be a mapping, not {type(tensors).__name__}")
        if not isinstance(meta, Mapping):
            raise CheckpointError(f"meta must be a mapping, not {type(meta).__name__}")
        seen: set[str] = set()
        arrays = {_check_name(k, seen): _as_array(str(k), v) for k, v in tensors.items()}
        user_meta: dict[str, Any] = _plain_json(meta, "meta", set())
        with self._lock:
            self._check_writable()
            finals, _ = self._scan()
            sequence = finals[-1].sequence + 1 if finals else 1
            final = self.folder / _folder_name(sequence)
            temp = self.folder / f".{final.name}.tmp-{secrets.token_hex(4)}"
            try:
                size = self._write(temp, sequence, arrays, user_meta)
                if final.exists():  # renaming onto an empty folder would replace it
                    raise CheckpointError(f"{final} appeared during the save; not replaced")
                temp.rename(final)
                _fsync_path(self.folder)
            except PermissionError as e:
                shutil.rmtree(temp, ignore_errors=True)
                raise CheckpointError(
                    f"checkpoint folder {self.folder} is not writable: {e.strerror or e}"
                ) from None
            except BaseException:
                shutil.rmtree(temp, ignore_errors=True)
                raise
            self._remember(CheckpointInfo(sequence, final), True)
            self._prune(sequence)
        self.last_save_s = time.perf_counter() - started
        log.info(
            "checkpoint %s saved: %d tensors, %.1f MB in %.2f s",
            final.name,
            len(arrays),
            size / 1e6,
            self.last_save_s,
        )
        return final

    def _write(
        self,
        temp: Path,
        sequence: int,
        arrays: Mapping[str, npt.NDArray[Any]],
        user_meta: dict[str, Any],
    ) -> int:
        """Write both files into ``temp`` and flush them; returns the tensors file's size."""
        temp.mkdir()
        tensors_path = temp / TENSORS_FILE
        save_file(dict(arrays), tensors_path)
        _fsync_path(tensors_path)
        record: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "sequence": sequence,
            "saved_at": time.time(),
            "tensors_bytes": tensors_path.stat().st_size,
            "tensors_count": len(arrays),
            "tensors_sha256": _file_sha256(tensors_path),
            "meta": user_meta,
        }
        record["meta_sha256"] = _record_digest(record)
        text = json.dumps(record, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False)
        with (temp / META_FILE).open("x", encoding="ascii") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(temp)
        return int(record["tensors_bytes"])

    @staticmethod
    def _stat_key(info: CheckpointInfo) -> tuple[int, ...]:
        key: builtins.list[int] = []
        for name in (META_FILE, TENSORS_FILE):
            try:
                st = (info.path / name).stat()
            except OSError:
                return ()
            key += [st.st_ino, st.st_size, st.st_mtime_ns]
        return tuple(key)

    def _remember(self, info: CheckpointInfo, ok: bool) -> None:
        self._verified[info.path.name] = (self._stat_key(info), ok)

    def _is_valid(self, info: CheckpointInfo) -> bool:
        """Whether ``info`` verifies; each unchanged checkpoint is hashed once per store."""
        cached = self._verified.get(info.path.name)
        if cached is not None and cached[0] and cached[0] == self._stat_key(info):
            return cached[1]
        ok = info.problem() is None
        self._remember(info, ok)
        return ok

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` valid checkpoints (and any broken one newer than the
        oldest of those); remove the rest and leftover hidden folders."""
        finals, hidden = self._scan()
        for path, kind in hidden:
            if kind == "tmp":
                log.info("removing %s, left by a save that never finished", path.name)
            shutil.rmtree(path, ignore_errors=True)
        valid = 0
        for info in reversed(finals):
            if valid < self.keep or info.sequence >= newest:
                valid += info.sequence == newest or self._is_valid(info)
                continue
            # hide it first, so that a crash mid-removal leaves no torn checkpoint in view
            doomed = self.folder / f".{info.path.name}.del-{secrets.token_hex(4)}"
            try:
                info.path.rename(doomed)
            except OSError as e:
                log.warning("cannot remove old checkpoint %s: %s", info.path.name, e)
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            self._verified.pop(info.path.name, None)
            log.debug("removed old checkpoint %s", info.path.name)
