"""The built-in decoder-only transformer and its named presets.

A small GPT in the style of the models the DiLoCo papers train (pre-norm blocks, causal
self-attention, a 4x MLP), with a choice of rotary (RoPE) or learned positions and
optionally tied input/output embeddings. Every parameter name carries its block index
(``blocks.{i}.``), which is what the Streaming DiLoCo fragment planner (arXiv 2501.18512)
uses to assign whole blocks to fragments.

Presets run from ``micro`` (tests, a few seconds on a CPU) through ``tiny`` (a laptop CPU
in minutes) to ``1b`` (GPU peers). ``from_hf_config`` builds any Hugging Face causal-LM
config instead, when the optional ``transformers`` package is installed.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from atoll.protocol.errors import ConfigError
from atoll.protocol.fragments import FragmentPlan, TensorSpec, plan_fragments

if TYPE_CHECKING:
    from atoll.protocol.manifest import RunManifest

__all__ = [
    "GPT",
    "PRESETS",
    "ModelConfig",
    "build",
    "build_for_run",
    "build_model",
    "from_hf_config",
    "model_config",
    "tensor_specs",
]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the built-in transformer."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 96
    n_layers: int = 6
    n_heads: int = 4
    mlp_ratio: int = 4
    positions: str = "rope"  # "rope" or "learned"
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.positions not in ("rope", "learned"):
            raise ConfigError(f"positions must be 'rope' or 'learned', not {self.positions!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise ConfigError("rotary positions need an even head dimension")
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")

    def approx_params(self) -> int:
        """Parameter count without building the model (embeddings counted once if tied)."""
        d = self.d_model
        per_block = 4 * d * d + 2 * self.mlp_ratio * d * d + 2 * d  # attention, MLP, 2 norms
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        pos = self.seq_len * d if self.positions == "learned" else 0
        return self.n_layers * per_block + emb + pos + d


PRESETS: dict[str, ModelConfig] = {
    # unit and integration tests: trains in seconds on one CPU core
    "micro": ModelConfig(seq_len=64, d_model=32, n_layers=2, n_heads=2),
    # the default: ~0.7M parameters, a laptop CPU trains it in minutes
    "tiny": ModelConfig(seq_len=128, d_model=96, n_layers=6, n_heads=4),
    "small": ModelConfig(seq_len=256, d_model=256, n_layers=6, n_heads=8),  # ~4.8M
    "base": ModelConfig(seq_len=512, d_model=512, n_layers=12, n_heads=8),  # ~38M
    "125m": ModelConfig(seq_len=1024, d_model=768, n_layers=12, n_heads=12, vocab_size=256),
    "350m": ModelConfig(seq_len=1024, d_model=1024, n_layers=24, n_heads=16),
    "1b": ModelConfig(seq_len=2048, d_model=2048, n_layers=18, n_heads=16),
}


def model_config(preset: str, **overrides: Any) -> ModelConfig:
    """The named preset with ``overrides`` applied (unknown names raise ConfigError)."""
    try:
        base = PRESETS[preset]
    except KeyError:
        raise ConfigError(f"unknown model preset {preset!r}; known: {', '.join(PRESETS)}") from None
    unknown = set(overrides) - set(asdict(base))
    if unknown:
        raise ConfigError(f"unknown model settings: {', '.join(sorted(unknown))}")
    return replace(base, **overrides)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rope_tables(seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, laid out for the rotate-half form."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)  # (seq, head_dim)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions (RoFormer, arXiv 2104.09864) in the rotate-half layout.

    x: (..., seq, head_dim); pairs (i, i + head_dim/2) rotate by the position's angle.
    """
    t, half = x.shape[-2], x.shape[-1] // 2
    c, s = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.rope = cfg.positions == "rope"
        self.dropout = cfg.dropout
        self.attn_norm = RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d, bias=False)
        self.out = nn.Linear(cfg.mlp_ratio * d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, batch, heads, seq, head_dim)
        if self.rope:  # one rotation for q and k together
            qk = _apply_rope(qkv[:2], cos, sin)
            q, k, v = qk[0], qk[1], qkv[2]
        else:
            q, k, v = qkv[0], qkv[1], qkv[2]
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.mlp_norm(x))))
        return out


class GPT(nn.Module):
    """Decoder-only language model over a byte (or any small) vocabulary."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        cos, sin = _rope_tables(cfg.seq_len, cfg.d_model // cfg.n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)
        # GPT-2 style: shrink the residual projections with depth
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for token ids of shape (batch, seq)."""
        if idx.shape[1] > self.cfg.seq_len:
            raise ConfigError(f"sequence of {idx.shape[1]} exceeds seq_len={self.cfg.seq_len}")
        x = self.embed(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        x = self.norm(x)
        if self.head is None:
            return F.linear(x, self.embed.weight)
        out: torch.Tensor = self.head(x)
        return out

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy in nats."""
        logits = self(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    """A freshly initialised model; the same seed gives the same weights on every peer."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return GPT(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


_BLOCK_RE = re.compile(r"(?:^|\.)(?:blocks|layers|h|layer)\.(\d+)\.")


def tensor_specs(model: nn.Module) -> list[TensorSpec]:
    """Describe the trainable tensors for the fragment planner, in model order.

    A tensor belongs to block ``i`` when its name contains ``blocks.i.`` (or the
    ``layers.i.`` / ``h.i.`` naming of Hugging Face models); everything else
    (embeddings, final norm, head) has no block.
    """
    specs = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        m = _BLOCK_RE.search(name)
        specs.append(TensorSpec(name, tuple(p.shape), int(m.group(1)) if m else None))
    return specs


def from_hf_config(hf_config: Any, seed: int = 0) -> HFCausalLM:
    """Build a Hugging Face causal LM from its config (needs the ``transformers`` extra)."""
    transformers = _transformers()
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return HFCausalLM(transformers.AutoModelForCausalLM.from_config(hf_config))
    finally:
        torch.random.set_rng_state(gen_state)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "a Hugging Face model config needs the optional 'transformers' package: "
            "pip install 'atoll[hf]'"
        ) from None
    return transformers


def build(spec: str, seed: int = 0, max_seq_len: int = 1024) -> tuple[nn.Module, int]:
    """A model and its training sequence length from a preset name or ``hf:CONFIG``.

    ``hf:path`` names a local Hugging Face ``config.json`` (or its folder); nothing is
    downloaded. Its vocabulary must cover the 256 byte values.
    """
    if not spec.startswith("hf:"):
        cfg = model_config(spec)
        return build_model(cfg, seed), cfg.seq_len
    path = spec[3:]
    try:
        hf_cfg = _transformers().AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the Hugging Face config {path}: {e}") from None
    if getattr(hf_cfg, "vocab_size", 0) < 256:
        raise ConfigError(f"{path}: vocab_size must be >= 256 for byte-level data")
    positions: int = (
        getattr(hf_cfg, "max_position_embeddings", None)
        or getattr(hf_cfg, "n_positions", None)
        or max_seq_len
    )
    return from_hf_config(hf_cfg, seed), min(int(positions), max_seq_len)


def build_for_run(manifest: RunManifest) -> tuple[nn.Module, int, FragmentPlan]:
    """The run's model (the seed's weights), its sequence length and its fragment plan:
    what every peer of the run builds alike (a trainer, an export)."""
    model, seq_len = build(manifest.model, manifest.seed)
    plan = plan_fragments(
        tensor_specs(model),
        blocks_per_fragment=manifest.blocks_per_fragment,
        extras=manifest.extras,
    )
    return model, seq_len, plan


class HFCausalLM(nn.Module):
    """Adapter giving a Hugging Face causal LM the built-in model's ``loss`` interface."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.inner(input_ids=idx).logits
        return logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
