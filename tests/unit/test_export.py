"""``atoll export``: the global model of a node checkpoint, written as safetensors with
its config, loads back as the same weights; a checkpoint of another run is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from atoll.node.checkpoint import CheckpointStore
from atoll.node.cli import main
from atoll.node.export import export_model, load_exported
from atoll.node.model import build, tensor_specs
from atoll.node.snapshot import KIND, engine_arrays
from atoll.node.train import FragmentViews
from atoll.protocol.engine import OuterEngine
from atoll.protocol.errors import ConfigError
from atoll.protocol.fragments import plan_fragments
from atoll.protocol.manifest import RunManifest
from atoll.protocol.schedule import Schedule

MANIFEST = 'name = "export-test"\nmodel = "micro"\nH = 8\nblocks_per_fragment = 1\n'


def _checkpoint(tmp: Path, manifest: RunManifest) -> tuple[Path, list[np.ndarray]]:
    """A node checkpoint whose global copies differ from the seed's, as after training."""
    model, _ = build(manifest.model, manifest.seed)
    plan = plan_fragments(
        tensor_specs(model),
        blocks_per_fragment=manifest.blocks_per_fragment,
        extras=manifest.extras,
    )
    views = FragmentViews(model, plan)
    rng = np.random.default_rng(4)
    globals_ = [
        views.get(p) + rng.standard_normal(views.numel(p), dtype=np.float32)
        for p in range(len(plan))
    ]
    engine = OuterEngine(manifest.engine_config(), Schedule(manifest.H, len(plan)), globals_)
    tensors, part = engine_arrays(engine.state_dict())
    tensors["model/local-only"] = np.zeros(3, np.float32)  # the node's own weights: not exported
    store = CheckpointStore(tmp / "ckpts")
    meta = {
        "kind": KIND,
        "run_id": manifest.run_id(),
        "peer_id": "p",
        "step": 40,
        "tokens": 9,
        "versions": [0] * len(plan),
        "engine": part,
    }
    store.save(tensors, meta)
    return store.folder, globals_


def test_export_writes_the_global_model_and_its_config(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(MANIFEST)
    manifest = RunManifest.load(run)
    folder, globals_ = _checkpoint(tmp_path, manifest)
    done = export_model(run, folder, tmp_path / "out")
    assert done.step == 40 and "exported the global model" in done.describe()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model"] == "micro" and config["run_id"] == manifest.run_id()
    assert config["config"]["n_layers"] >= 1
    model = load_exported(tmp_path / "out")
    model_again, _ = build("micro", manifest.seed)
    plan = plan_fragments(tensor_specs(model_again), blocks_per_fragment=1, extras=manifest.extras)
    views = FragmentViews(model, plan)
    for p, g in enumerate(globals_):
        np.testing.assert_array_equal(views.get(p), g)
    # the exported model runs
    x = torch.zeros(1, 8, dtype=torch.long)
    assert torch.isfinite(model.loss(x, x))  # type: ignore[operator]


def test_export_refuses_another_run_and_a_used_folder(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(MANIFEST)
    folder, _ = _checkpoint(tmp_path, RunManifest.load(run))
    other = tmp_path / "other.toml"
    other.write_text(MANIFEST.replace("export-test", "another-run"))
    with pytest.raises(ConfigError, match="is of run"):
        export_model(other, folder, tmp_path / "out")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("keep me")
    with pytest.raises(ConfigError, match="not an empty folder"):
        export_model(run, folder, tmp_path / "used")
    assert (tmp_path / "used" / "x").read_text() == "keep me"


def test_the_command_line_says_one_line_for_a_missing_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run.toml"
    run.write_text(MANIFEST)
    code = main(
        [
            "export",
            "--run",
            str(run),
            "--out",
            str(tmp_path / "o"),
            "--checkpoint",
            str(tmp_path / "nowhere"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint folder" in err[0]
