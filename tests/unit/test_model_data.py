"""The built-in model, the corpus and deterministic batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from atoll.node.data import Batcher, load_corpus, stdlib_corpus, text_corpus
from atoll.node.model import PRESETS, build_model, model_config, tensor_specs
from atoll.protocol.errors import ConfigError
from atoll.protocol.fragments import plan_fragments


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus()


def test_presets_build_and_count_params() -> None:
    for name in ("micro", "tiny"):
        cfg = PRESETS[name]
        model = build_model(cfg)
        n = sum(p.numel() for p in model.parameters())
        assert n == cfg.approx_params()
    assert 0.6e6 < PRESETS["tiny"].approx_params() < 0.8e6
    assert 0.9e9 < PRESETS["1b"].approx_params() < 1.3e9


def test_same_seed_same_weights_and_causal() -> None:
    cfg = model_config("micro")
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), na
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256  # change the future
    with torch.no_grad():
        assert torch.allclose(a(x)[:, :10], a(y)[:, :10], atol=1e-5)
        assert not torch.allclose(a(x)[:, 10:], a(y)[:, 10:])


@pytest.mark.parametrize("positions,tied", [("rope", True), ("learned", False)])
def test_variants_initial_loss_near_uniform(positions: str, tied: bool) -> None:
    cfg = model_config("micro", positions=positions, tie_embeddings=tied)
    model = build_model(cfg)
    x = torch.randint(0, 256, (4, cfg.seq_len))
    loss = float(model.loss(x[:, :-1], x[:, 1:]).detach())
    assert abs(loss - math.log(256)) < 0.3


def test_bad_model_settings_are_clear() -> None:
    with pytest.raises(ConfigError, match="unknown model preset"):
        model_config("huge")
    with pytest.raises(ConfigError, match="divisible"):
        model_config("micro", n_heads=3)
    with pytest.raises(ConfigError, match="unknown model settings"):
        model_config("micro", depth=3)


def test_tensor_specs_mark_blocks_for_the_planner() -> None:
    model = build_model(model_config("tiny"))
    specs = tensor_specs(model)
    blocks = {s.block for s in specs if s.block is not None}
    assert blocks == set(range(6))
    extras = [s.name for s in specs if s.block is None]
    assert extras == ["embed.weight", "norm.weight"]
    plan = plan_fragments(specs, blocks_per_fragment=3)
    assert len(plan) == 3  # 2 strided block fragments + embeddings/norm
    assert plan.fragments[0].blocks == (0, 2, 4)


def test_stdlib_corpus_is_deterministic_and_split(corpus) -> None:
    again = stdlib_corpus()
    assert again.fingerprint == corpus.fingerprint
    assert corpus.train.size > 1_000_000 and corpus.val.size > 50_000
    assert 0.02 < corpus.val.size / (corpus.train.size + corpus.val.size) < 0.12


def test_batches_depend_only_on_seed_replica_step(corpus) -> None:
    b1, b2 = Batcher(corpus, 64, 4, seed=7), Batcher(corpus, 64, 4, seed=7)
    x1, y1 = b1.batch(2, 10)
    x2, y2 = b2.batch(2, 10)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(b1.batch(3, 10)[0], x1)
    assert not torch.equal(b1.batch(2, 11)[0], x1)
    assert not torch.equal(Batcher(corpus, 64, 4, seed=8).batch(2, 10)[0], x1)
    v1, v2 = b1.val_batches(2), Batcher(corpus, 64, 4, seed=99).val_batches(2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2, strict=True))


def test_user_text_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world " * 400)
    with (tmp_path / "b.jsonl").open("w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"document number {i} " * 20}) + "\n")
    corpus = load_corpus(f"{tmp_path / 'a.txt'},{tmp_path / 'b.jsonl'}")
    assert corpus.train.size + corpus.val.size > 5000
    x, _ = Batcher(corpus, 32, 2).batch(0, 0)
    assert x.shape == (2, 32)


def test_bad_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        text_corpus([tmp_path / "nope.txt"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        text_corpus([bad])
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(ConfigError, match="too small"):
        text_corpus([tmp_path / "small.txt"])


def test_hugging_face_config_trains_when_transformers_is_installed(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    cfg.save_pretrained(tmp_path)
    from atoll.node.model import build

    model, seq_len = build(f"hf:{tmp_path}")
    assert seq_len == 32
    specs = tensor_specs(model)
    assert {s.block for s in specs} == {0, 1, None}
    plan = plan_fragments(specs, blocks_per_fragment=1)
    assert len(plan) == 3
    x = torch.randint(0, 256, (2, 33))
    assert math.isfinite(float(model.loss(x[:, :-1], x[:, 1:])))  # type: ignore[operator]


def test_hugging_face_config_errors_are_clear(tmp_path: Path) -> None:
    from atoll.node.model import build

    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="transformers"):
            build(f"hf:{tmp_path}")
    else:
        with pytest.raises(ConfigError, match="cannot read"):
            build(f"hf:{tmp_path / 'missing'}")
