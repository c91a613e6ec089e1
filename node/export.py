"""``atoll export``: the swarm's global model, from a node's checkpoint, for use outside atoll.

The global model is every fragment's global copy (the swarm's average after its last
outer step), not the node's local weights, which drift between syncs. Written into one
folder:

- ``model.safetensors``: the model's state dict (atoll's own GPT presets), each tensor
  stored on its own (tied weights appear under both names);
- ``config.json``: the model (preset name and its configuration, or the ``hf:`` path),
  the sequence length, the byte-level vocabulary, and where the weights come from: run
  id, peer, inner step, every fragment's version and state digest;
- ``hf/`` for an ``hf:`` model: the Hugging Face folder ``save_pretrained`` writes
  (config and safetensors weights), loadable with ``from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from atoll.node.checkpoint import CheckpointError, CheckpointStore, Loaded, load_checkpoint
from atoll.node.model import HFCausalLM, build_for_run, model_config
from atoll.node.snapshot import KIND
from atoll.node.train import FragmentViews
from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import RunManifest

__all__ = ["Exported", "export_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Exported:
    """What :func:`export_model` wrote."""

    out: Path
    checkpoint: Path
    step: int
    versions: tuple[int, ...]
    params: int

    def describe(self) -> str:
        versions = ", ".join(f"v{v}" for v in self.versions)
        return (
            f"exported the global model ({self.params / 1e6:.2f}M parameters; fragments at "
            f"{versions}; step {self.step}) from {self.checkpoint} to {self.out}"
        )


def _checkpoint(folder: Path) -> Loaded:
    """The newest valid checkpoint in a node's checkpoint folder, or the checkpoint that
    ``folder`` itself is."""
    if folder.name.startswith("ckpt-"):
        return load_checkpoint(folder)
    if not folder.is_dir():
        raise ConfigError(f"no checkpoint folder {folder}")
    loaded = CheckpointStore(folder, read_only=True).latest()
    if loaded is None:
        raise ConfigError(f"{folder} holds no checkpoint that verifies")
    return loaded


def export_model(manifest_path: str | Path, checkpoint: str | Path, out: str | Path) -> Exported:
    """Write the global model of the newest checkpoint in ``checkpoint`` (a node's
    checkpoint folder, or one ``ckpt-NNNNNN`` folder) into ``out``. ConfigError when the
    checkpoint is of another run, does not verify, or ``out`` holds files already."""
    manifest = RunManifest.load(Path(manifest_path).expanduser())
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"{target} exists and is not an empty folder; not overwritten")
    try:
        loaded = _checkpoint(Path(checkpoint).expanduser())
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    meta = loaded.meta
    if meta.get("kind") != KIND:
        raise ConfigError(f"{loaded.path} is not a node checkpoint")
    if meta.get("run_id") != manifest.run_id():
        raise ConfigError(
            f"{loaded.path} is of run {str(meta.get('run_id'))[:16]}, the manifest's is "
            f"{manifest.run_id()[:16]}: export with the manifest the node trained with"
        )
    model, seq_len, plan = build_for_run(manifest)
    views = FragmentViews(model, plan)
    for p in range(len(plan)):
        key = f"engine/{p}/global"
        if key not in loaded.tensors:
            raise ConfigError(f"{loaded.path} has no global copy of fragment {p}")
        views.set(p, np.asarray(loaded.tensors[key], np.float32))
    target.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    save_file(tensors, str(target / "model.safetensors"), metadata={"run_id": manifest.run_id()})
    versions = tuple(int(v) for v in meta.get("versions", []))
    config: dict[str, Any] = {
        "model": manifest.model,
        "seq_len": seq_len,
        "vocab_size": 256,
        "tokenizer": "bytes (token = byte value)",
        "run_id": manifest.run_id(),
        "run_name": manifest.name,
        "peer_id": meta.get("peer_id", ""),
        "step": int(meta.get("step", 0)),
        "versions": list(versions),
        "digests": list(meta.get("digests", [])),
        "checkpoint": str(loaded.path),
    }
    if manifest.model.startswith("hf:"):
        assert isinstance(model, HFCausalLM)
        model.inner.save_pretrained(str(target / "hf"), safe_serialization=True)  # type: ignore[operator]
        config["hf"] = "hf"
    else:
        config["config"] = dataclasses.asdict(model_config(manifest.model))
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    n_params = sum(p.numel() for p in model.parameters())
    done = Exported(target, loaded.path, int(meta.get("step", 0)), versions, n_params)
    log.info("%s", done.describe())
    return done


def load_exported(folder: str | Path) -> torch.nn.Module:
    """The model an export of an atoll preset wrote, rebuilt and loaded (for checks and
    for users of the plain PyTorch model)."""
    from safetensors.torch import load_file

    from atoll.node.model import build_model

    path = Path(folder)
    config = json.loads((path / "config.json").read_text())
    if "config" not in config:
        raise ConfigError(
            f"{path} holds a Hugging Face model: load {path / 'hf'} with transformers"
        )
    model = build_model(model_config(config["model"]))
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model
