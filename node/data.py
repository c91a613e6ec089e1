"""Training data that needs no download, and deterministic batches.

The default corpus is the source of the Python standard library that runs atoll: every
machine with Python has it. Text is read as bytes (a byte-level tokenizer, vocabulary
256), documents are joined with a 0 byte, and each file goes to the validation split when
a hash of its relative path says so, so the split is the same on every peer with the same
Python. Users can point at their own ``.txt``/``.md``/``.py`` or ``.jsonl`` files instead.

A batch is a pure function of ``(seed, replica, step)``: any peer's work can be recomputed
later by anyone holding the same corpus, which is what verification of untrusted peers
(BTARD, arXiv 2106.11257) needs. The corpus fingerprint names exactly which bytes those are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from atoll.protocol.errors import ConfigError

__all__ = ["Batcher", "Corpus", "load_corpus", "stdlib_corpus", "text_corpus"]

log = logging.getLogger(__name__)

_SEPARATOR = b"\x00"
_VAL_EVERY = 20  # one document in 20 goes to validation
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".csv", ".html", ".c", ".h"}


@dataclass(frozen=True)
class Corpus:
    """Byte-level train and validation token streams, with a fingerprint of their content."""

    name: str
    train: np.ndarray  # uint8
    val: np.ndarray  # uint8
    fingerprint: str  # sha256 over both splits

    vocab_size: int = 256

    def describe(self) -> str:
        return (
            f"{self.name}: {self.train.size / 1e6:.1f} MB train, {self.val.size / 1e6:.2f} MB val, "
            f"sha256 {self.fingerprint[:12]}"
        )


def _in_val(key: str) -> bool:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % _VAL_EVERY == 0


def _build(name: str, docs: Iterable[tuple[str, bytes]]) -> Corpus:
    train: list[bytes] = []
    val: list[bytes] = []
    for key, text in docs:
        (val if _in_val(key) else train).append(text)
    if not train or not val:
        # too few documents to split by name: hold out the tail of the concatenation
        joined = _SEPARATOR.join(train + val)
        cut = int(len(joined) * (1 - 1 / _VAL_EVERY))
        train, val = [joined[:cut]], [joined[cut:]]
    tr = _SEPARATOR.join(train)
    va = _SEPARATOR.join(val)
    digest = hashlib.sha256(tr)
    digest.update(b"|val|")
    digest.update(va)
    corpus = Corpus(
        name,
        np.frombuffer(tr, dtype=np.uint8),
        np.frombuffer(va, dtype=np.uint8),
        digest.hexdigest(),
    )
    log.info("corpus %s", corpus.describe())
    return corpus


def stdlib_corpus(root: str | os.PathLike[str] | None = None) -> Corpus:
    """The ``.py`` files of the running Python's standard library (no download)."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ConfigError(f"standard library folder not found: {base}")

    def docs() -> Iterable[tuple[str, bytes]]:
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for fname in sorted(filenames):
                if fname.endswith(".py"):
                    path = Path(dirpath) / fname
                    yield str(path.relative_to(base)), path.read_bytes()

    return _build(f"stdlib-{base.name}", docs())


def _jsonl_texts(path: Path) -> Iterable[tuple[str, bytes]]:
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"{path}:{lineno}: expected an object with a string 'text' field")
            yield f"{path.name}:{lineno}", text.encode("utf-8")


def text_corpus(paths: Sequence[str | os.PathLike[str]]) -> Corpus:
    """User data: text files (one document each) and ``.jsonl`` files (a ``text`` field per line).

    Folders are searched recursively for files with a text suffix.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.suffix in _TEXT_SUFFIXES))
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"data path does not exist: {p}")
    if not files:
        raise ConfigError(f"no text files found in {', '.join(map(str, paths))}")

    def docs() -> Iterable[tuple[str, bytes]]:
        for f in files:
            if f.suffix == ".jsonl":
                yield from _jsonl_texts(f)
            else:
                yield str(f), f.read_bytes()

    corpus = _build(
        "+".join(f.name for f in files[:3]) + ("+..." if len(files) > 3 else ""), docs()
    )
    if corpus.train.size < 2048:
        raise ConfigError(f"data too small to train on: {corpus.train.size} bytes")
    return corpus


def load_corpus(spec: str = "stdlib") -> Corpus:
    """``"stdlib"`` or a comma-separated list of files and folders."""
    if spec == "stdlib":
        return stdlib_corpus()
    return text_corpus([s for s in spec.split(",") if s])


class Batcher:
    """Deterministic batches: the same ``(seed, replica, step)`` always gives the same tokens."""

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int = 0) -> None:
        if corpus.train.size <= seq_len + 1 or corpus.val.size <= seq_len + 1:
            raise ConfigError(f"corpus {corpus.name} is shorter than one sequence of {seq_len}")
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self._window = np.arange(seq_len + 1)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def _take(self, data: np.ndarray, rng: np.random.Generator, n: int) -> torch.Tensor:
        starts = rng.integers(0, data.size - self.seq_len - 1, size=n)
        return torch.from_numpy(data[starts[:, None] + self._window].astype(np.int64))

    def batch(self, replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each of shape (batch_size, seq_len)."""
        rng = np.random.default_rng([self.seed, replica, step])
        chunk = self._take(self.corpus.train, rng, self.batch_size)
        return chunk[:, :-1], chunk[:, 1:]

    def val_batches(
        self, n_batches: int, batch_size: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed validation set (independent of the training seed, so runs compare)."""
        rng = np.random.default_rng([0xA7011, self.seq_len])
        out = []
        for _ in range(n_batches):
            chunk = self._take(self.corpus.val, rng, batch_size or self.batch_size)
            out.append((chunk[:, :-1], chunk[:, 1:]))
        return out
