"""Document batches: whole documents of variable length, trained as micro-batches.

With ``batching = "documents"`` in the run manifest, a batch is no longer ``batch_size``
random windows of ``seq_len`` bytes but a set of documents (the corpus's documents are
the stretches between its 0-byte separators). Documents are drawn uniformly at random,
each cut to a random window of at most ``seq_len + 1`` bytes, until the batch holds
``batch_size × seq_len`` predicted tokens, the same budget as a batch of windows (the
last document is cut shorter to fill it exactly). The documents of a batch are a pure
function of ``(seed, replica, step)``, like the windows of :class:`~atoll.node.data.Batcher`.

The node trains such a batch as ``micro_batches`` micro-batches with gradient
accumulation. Each micro-batch is padded on the right to its own longest document; the
targets of the padding are ignored by the loss, and the model's causal attention keeps
real tokens from seeing the padding to their right, so no attention mask is needed. Each
micro-batch's mean loss is weighted by its share of the batch's tokens, so the step's
gradient is the per-token mean over the whole batch whichever way it is cut (up to float
rounding). How it is cut is the node's choice, :mod:`atoll.protocol.packing`:

- ``plain``: documents in arrival order, equal counts per micro-batch;
- ``kk``: micro-batches of balanced cost (linear or quadratic in length), by the
  Karmarkar-Karp largest differencing method with greedy swaps, as in ODC (arXiv
  2601.19362).

Validation batches stay the fixed windows of the plain batcher, so evaluations compare
across batching modes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from atoll.node.data import Batcher, Corpus
from atoll.node.settings import NodeConfig
from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import RunManifest
from atoll.protocol.packing import COSTS, PACKINGS, pack

__all__ = ["IGNORE", "DocumentBatcher", "MicroBatch", "document_spans", "make_batcher"]

log = logging.getLogger(__name__)

IGNORE = -100
"""Target of a padding position: the cross entropy's ``ignore_index``."""

_SEPARATOR = 0
_STREAM = 0xD0C5  # keeps the documents' random stream apart from the windows'


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Inputs and targets of shape (documents, width), padded on the right."""

    inputs: torch.Tensor
    targets: torch.Tensor  # IGNORE at padding
    tokens: int
    """predicted (non-padding) tokens"""

    @property
    def padded_tokens(self) -> int:
        """Positions the model computes, padding included."""
        return int(self.inputs.numel())


def document_spans(data: np.ndarray, min_len: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Start offsets and lengths of the documents of a token stream (split at 0 bytes),
    those shorter than ``min_len`` left out."""
    cuts = np.flatnonzero(data == _SEPARATOR)
    starts = np.concatenate(([0], cuts + 1)).astype(np.int64)
    ends = np.concatenate((cuts, [data.size])).astype(np.int64)
    keep = ends - starts >= min_len
    return starts[keep], (ends - starts)[keep]


class DocumentBatcher(Batcher):
    """Batches of whole documents and their micro-batches (see the module docstring)."""

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        *,
        micro_batches: int = 4,
        packing: str = "plain",
        cost: str = "quadratic",
    ) -> None:
        super().__init__(corpus, seq_len, batch_size, seed)
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            raise ConfigError(f"micro_batches must be an int, not {micro_batches!r}")
        if micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, not {micro_batches}")
        if packing not in PACKINGS:
            raise ConfigError(f"packing must be one of {PACKINGS}, not {packing!r}")
        if cost not in COSTS:
            raise ConfigError(f"packing cost must be one of {COSTS}, not {cost!r}")
        self.micro_batches_per_step = micro_batches
        self.packing = packing
        self.cost = cost
        self._starts, self._lengths = document_spans(corpus.train)
        if not self._starts.size:
            raise ConfigError(f"corpus {corpus.name} has no document of 2 bytes or more")

    @property
    def documents_in_corpus(self) -> int:
        return int(self._starts.size)

    def documents(self, replica: int, step: int) -> list[np.ndarray]:
        """The batch's documents (uint8, at most ``seq_len + 1`` bytes each, at least 2),
        holding ``batch_size × seq_len`` predicted tokens in all."""
        rng = np.random.default_rng([self.seed, replica, step, _STREAM])
        train = self.corpus.train
        budget = self.tokens_per_batch
        out = []
        while budget > 0:
            d = int(rng.integers(self._starts.size))
            length = int(self._lengths[d])
            take = min(length, self.seq_len + 1, budget + 1)
            start = int(self._starts[d]) + int(rng.integers(0, length - take + 1))
            out.append(train[start : start + take])
            budget -= take - 1
        return out

    def micro_batches(self, replica: int, step: int) -> list[MicroBatch]:
        """The batch cut into at most ``micro_batches`` micro-batches by the node's packing
        (empty ones left out), each padded to its own longest document."""
        docs = self.documents(replica, step)
        plan = pack(
            [d.size - 1 for d in docs], self.micro_batches_per_step, self.packing, self.cost
        )
        return [_padded([docs[i] for i in group]) for group in plan.bins if group]

    def batch(self, replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch as one (inputs, targets) pair padded to ``seq_len``, for callers
        that concatenate the batches of several replicas."""
        mb = _padded(self.documents(replica, step), width=self.seq_len)
        return mb.inputs, mb.targets


def _padded(docs: list[np.ndarray], width: int = 0) -> MicroBatch:
    """Inputs and shifted targets of ``docs``, right-padded to ``width`` or the longest."""
    width = max(width, max(d.size - 1 for d in docs))
    inputs = np.zeros((len(docs), width), dtype=np.int64)
    targets = np.full((len(docs), width), IGNORE, dtype=np.int64)
    for row, d in enumerate(docs):
        n = d.size - 1
        inputs[row, :n] = d[:-1]
        targets[row, :n] = d[1:]
    tokens = sum(d.size - 1 for d in docs)
    return MicroBatch(torch.from_numpy(inputs), torch.from_numpy(targets), tokens)


def make_batcher(corpus: Corpus, seq_len: int, manifest: RunManifest, node: NodeConfig) -> Batcher:
    """The batcher of the run's ``batching`` mode; documents are cut as ``node`` says."""
    if manifest.batching != "documents":
        return Batcher(corpus, seq_len, manifest.batch_size, manifest.seed)
    batcher = DocumentBatcher(
        corpus,
        seq_len,
        manifest.batch_size,
        manifest.seed,
        micro_batches=node.micro_batches,
        packing=node.packing,
        cost=node.packing_cost,
    )
    log.info(
        "document batches: %d documents, %d micro-batches per step, %s packing (%s cost)",
        batcher.documents_in_corpus,
        node.micro_batches,
        node.packing,
        node.packing_cost,
    )
    return batcher
