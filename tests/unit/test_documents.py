"""Document batches and their micro-batches, and the trainer's gradient accumulation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from atoll.node.data import Batcher, Corpus
from atoll.node.documents import IGNORE, DocumentBatcher, document_spans, make_batcher
from atoll.node.model import build_model, model_config
from atoll.node.settings import NodeConfig
from atoll.node.train import InnerConfig, Replica
from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import RunManifest

SEQ = 32


def mixed_corpus(n_docs: int = 240, seed: int = 0) -> Corpus:
    """Documents of 1 to 200 bytes joined with 0 bytes; every byte of document i is i + 1,
    so a piece of a batch tells which document it came from."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(200, rng.geometric(1 / 25, n_docs))
    docs = [np.full(n, i + 1, dtype=np.uint8) for i, n in enumerate(lengths)]
    sep = np.zeros(1, dtype=np.uint8)
    train = np.concatenate([x for d in docs for x in (d, sep)][:-1])
    val = rng.integers(1, 256, 4096).astype(np.uint8)
    return Corpus("mixed", train, val, "0" * 64)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return mixed_corpus()


def batcher(corpus: Corpus, packing: str = "plain", **kw: object) -> DocumentBatcher:
    return DocumentBatcher(corpus, SEQ, 8, seed=3, packing=packing, **kw)  # type: ignore[arg-type]


def test_document_spans_split_at_zero_bytes_and_drop_the_short() -> None:
    data = np.array([5, 6, 0, 7, 0, 0, 1, 2, 3], dtype=np.uint8)
    starts, lengths = document_spans(data)
    assert starts.tolist() == [0, 6] and lengths.tolist() == [2, 3]
    starts, lengths = document_spans(data, min_len=1)
    assert starts.tolist() == [0, 3, 6] and lengths.tolist() == [2, 1, 3]


def test_a_batch_is_whole_documents_within_the_budget(corpus: Corpus) -> None:
    b = batcher(corpus)
    docs = b.documents(replica=1, step=5)
    assert sum(d.size - 1 for d in docs) == b.tokens_per_batch == 8 * SEQ
    assert all(2 <= d.size <= SEQ + 1 for d in docs)
    # each piece lies inside one document (one byte value, no separator), and is that
    # whole document unless it is longer than the cap (or the last, cut to the budget)
    starts, lengths = document_spans(corpus.train)
    length_of = {int(corpus.train[s]): int(n) for s, n in zip(starts, lengths, strict=True)}
    assert all(np.unique(d).size == 1 and d[0] != 0 for d in docs)
    assert all(d.size == min(length_of[int(d[0])], SEQ + 1) for d in docs[:-1])
    assert len({d.size for d in docs}) > 3  # the lengths do vary


def test_batches_are_a_function_of_replica_and_step(corpus: Corpus) -> None:
    a, b = batcher(corpus), batcher(corpus, "kk")
    pairs = zip(a.documents(0, 7), b.documents(0, 7), strict=True)
    assert all(np.array_equal(x, y) for x, y in pairs)  # the packing does not pick them
    first = [d.tobytes() for d in a.documents(0, 7)]
    assert first == [d.tobytes() for d in a.documents(0, 7)]
    assert first != [d.tobytes() for d in a.documents(0, 8)]
    assert first != [d.tobytes() for d in a.documents(1, 7)]
    for x, y in zip(a.micro_batches(0, 7), a.micro_batches(0, 7), strict=True):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)


@pytest.mark.parametrize(
    ("packing", "cost"), [("plain", "linear"), ("kk", "linear"), ("kk", "quadratic")]
)
def test_micro_batches_hold_every_document_once_padded_to_their_longest(
    corpus: Corpus, packing: str, cost: str
) -> None:
    b = batcher(corpus, packing, micro_batches=3, cost=cost)
    docs = b.documents(2, 4)
    micro = b.micro_batches(2, 4)
    assert 1 <= len(micro) <= 3
    rows = []
    for mb in micro:
        real = mb.targets != IGNORE
        lengths = real.sum(dim=1)
        assert mb.inputs.shape[1] == int(lengths.max())  # its own longest, not seq_len
        assert mb.tokens == int(real.sum()) and mb.padded_tokens == mb.inputs.numel()
        for row, n in zip(mb.inputs, lengths.tolist(), strict=True):
            assert torch.all(row[n:] == 0)
        for x, y, n in zip(mb.inputs, mb.targets, lengths.tolist(), strict=True):
            rows.append(np.concatenate([x[:n].numpy(), y[n - 1 : n].numpy()]).astype(np.uint8))
            assert torch.equal(x[1:n], y[: n - 1])  # targets are the inputs shifted by one
    assert sorted(r.tobytes() for r in rows) == sorted(d.tobytes() for d in docs)
    assert sum(mb.tokens for mb in micro) == b.tokens_per_batch


def test_kk_evens_the_micro_batches_that_plain_leaves_uneven(corpus: Corpus) -> None:
    plain, kk = (
        batcher(corpus, "plain", micro_batches=4),
        batcher(corpus, "kk", micro_batches=4, cost="linear"),
    )
    plain_gap = kk_gap = 0
    for step in range(20):
        plain_tokens = [mb.tokens for mb in plain.micro_batches(0, step)]
        kk_tokens = [mb.tokens for mb in kk.micro_batches(0, step)]
        assert len(plain_tokens) == 4 and len(kk_tokens) == 4
        plain_gap += max(plain_tokens) - min(plain_tokens)
        kk_gap += max(kk_tokens) - min(kk_tokens)
        assert max(kk_tokens) - min(kk_tokens) <= SEQ  # within one document of each other
    assert kk_gap * 4 < plain_gap


def test_the_whole_batch_pads_to_seq_len_for_callers_that_concatenate(corpus: Corpus) -> None:
    b = batcher(corpus)
    x, y = b.batch(0, 3)
    assert x.shape == y.shape == (len(b.documents(0, 3)), SEQ)
    assert int((y != IGNORE).sum()) == b.tokens_per_batch
    vx, vy = b.val_batches(2)[0]
    assert vx.shape == (8, SEQ) and torch.equal(vx[:, 1:], vy[:, :-1])  # windows, as before


def test_bad_settings_are_refused(corpus: Corpus) -> None:
    with pytest.raises(ConfigError, match="micro_batches"):
        batcher(corpus, micro_batches=0)
    with pytest.raises(ConfigError, match="packing must be"):
        batcher(corpus, "sorted")
    with pytest.raises(ConfigError, match="cost must be"):
        batcher(corpus, cost="cubic")
    no_docs = Corpus("x", np.array([1, 0] * 100, dtype=np.uint8), corpus.val, "0" * 64)
    with pytest.raises(ConfigError, match="no document"):
        DocumentBatcher(no_docs, 8, 2)


def replica(b: Batcher) -> Replica:
    model = build_model(model_config("micro", seq_len=SEQ), seed=1)
    return Replica(model, InnerConfig(warmup=1, total_steps=10), b, 0, torch.device("cpu"))


def test_plain_and_kk_packing_take_the_same_gradient_step(corpus: Corpus) -> None:
    """Gradient accumulation weighted by tokens: however the batch is cut, the step is the
    per-token mean over the whole batch, the same as one padded batch of it."""
    reps = [
        replica(batcher(corpus, "plain", micro_batches=4)),
        replica(batcher(corpus, "kk", micro_batches=4, cost="linear")),
        replica(batcher(corpus, "kk", micro_batches=3, cost="quadratic")),
    ]
    whole = replica(batcher(corpus, micro_batches=1))
    x, y = whole.batcher.batch(0, 0)
    with torch.no_grad():
        expected = float(whole.model.loss(x, y))  # type: ignore[operator]
    losses = [r.train_step(0) for r in reps]
    assert losses == pytest.approx([expected] * 3, abs=1e-5)
    # the gradients (kept after the step, clipped alike) agree; AdamW's first step is
    # about lr·sign(g), so the weights would differ wherever g is within rounding of 0
    grads = [{n: p.grad for n, p in r.model.named_parameters()} for r in reps]
    for name, g in grads[0].items():
        assert g is not None and float(g.abs().max()) > 0, name
        for other in grads[1:]:
            assert torch.allclose(g, other[name], rtol=1e-4, atol=1e-7), name
    fresh = replica(batcher(corpus)).model.parameters()
    pairs = zip(reps[0].model.parameters(), fresh, strict=True)
    assert any(not torch.equal(p, q) for p, q in pairs)  # the step did train


def test_the_windows_trainer_path_is_unchanged(corpus: Corpus) -> None:
    plain = Batcher(corpus, SEQ, 8, seed=3)
    a, b = replica(plain), replica(plain)
    x, y = plain.batch(0, 0)
    assert a.train_step(0) == b.train_step(0, [(x, y)])


def manifest(**kw: object) -> RunManifest:
    return RunManifest(name="docs", **kw)  # type: ignore[arg-type]


def test_make_batcher_follows_the_manifest_and_the_node(corpus: Corpus) -> None:
    node = NodeConfig(run="run.toml", micro_batches=5, packing="kk", packing_cost="linear")
    windows = make_batcher(corpus, SEQ, manifest(batch_size=4), node)
    assert type(windows) is Batcher and windows.batch_size == 4
    docs = make_batcher(corpus, SEQ, manifest(batch_size=4, batching="documents", seed=9), node)
    assert isinstance(docs, DocumentBatcher)
    assert (docs.micro_batches_per_step, docs.packing, docs.cost, docs.seed) == (
        5,
        "kk",
        "linear",
        9,
    )
    assert docs.tokens_per_batch == 4 * SEQ


def test_node_packing_settings_are_checked() -> None:
    assert NodeConfig(run="r.toml").packing == "plain"  # default: the plain packing
    for bad in ({"micro_batches": 0}, {"packing": "sorted"}, {"packing_cost": "cubic"}):
        with pytest.raises(ConfigError):
            NodeConfig(run="r.toml", **bad)  # type: ignore[arg-type]
    assert dataclasses.replace(NodeConfig(run="r.toml"), packing="kk").packing == "kk"
