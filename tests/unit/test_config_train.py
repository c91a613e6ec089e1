"""Config layering, the learning-rate schedule and fragment views."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from atoll.node.config import add_arguments, build_config, field_help, load_toml
from atoll.node.model import build_model, model_config, tensor_specs
from atoll.node.simulate import SimConfig
from atoll.node.train import FragmentViews, InnerConfig, lr_at
from atoll.protocol.errors import ConfigError
from atoll.protocol.fragments import plan_fragments
from atoll.protocol.manifest import OuterLoop


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p, SimConfig)
    return p.parse_args(argv)


def test_every_setting_has_a_flag_with_help() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, SimConfig)
    text = p.format_help()
    for flag in (
        "--algo",
        "--replicas",
        "--blocks-per-fragment",
        "--error-feedback",
        "--no-final-sync",
    ):
        assert flag in text
    assert "ddp, diloco or streaming" in field_help(SimConfig)["algo"]


def test_every_outer_loop_setting_is_a_simulate_flag_with_its_help() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, SimConfig, help_from=OuterLoop)
    text = " ".join(p.format_help().split())
    for f in dataclasses.fields(OuterLoop):
        assert f"--{f.name.replace('_', '-')}" in text
    assert field_help(OuterLoop)["outer_lr"] in text
    assert SimConfig().engine_config() == OuterLoop()
    diloco = SimConfig(algo="diloco", H=10).engine_config()
    assert diloco == OuterLoop(H=10, tau=0, alpha=0.0, codec="fp32")
    assert SimConfig(algo="diloco").with_(algo="streaming").engine_config() == OuterLoop()
    with pytest.raises(ConfigError, match="codec = 'fp7'"):
        SimConfig(codec="fp7")


def test_precedence_default_toml_env_cli(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[simulate]\nsteps = 10\nreplicas = 3\nalgo = "diloco"\nlr = 1\n')
    data = load_toml(toml, "simulate")
    env = {"ATOLL_REPLICAS": "5", "ATOLL_ERROR_FEEDBACK": "yes"}
    cfg = build_config(SimConfig, _parse("--algo", "ddp"), data, env)
    assert (cfg.steps, cfg.replicas, cfg.algo, cfg.lr) == (10, 5, "ddp", 1.0)
    assert cfg.error_feedback is True
    assert cfg.H == SimConfig().H  # untouched default


def test_config_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown setting 'stepz'"):
        build_config(SimConfig, None, {"stepz": 3}, {})
    with pytest.raises(ConfigError, match="ATOLL_STEPS"):
        build_config(SimConfig, None, None, {"ATOLL_STEPS": "ten"})
    broken = tmp_path / "x.toml"
    broken.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_toml(tmp_path / "none.toml")
    with pytest.raises(ConfigError, match="algo must be one of"):
        build_config(SimConfig, None, {"algo": "gossip"}, {})


def test_lr_schedule_warmup_then_cosine() -> None:
    cfg = InnerConfig(lr=1.0, warmup=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(500, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert math.isfinite(lr_at(0, InnerConfig(warmup=0)))


def test_fragment_views_round_trip_exactly() -> None:
    model = build_model(model_config("micro"))
    plan = plan_fragments(tensor_specs(model), blocks_per_fragment=1)
    views = FragmentViews(model, plan)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flats = [views.get(p) for p in range(len(views))]
    assert sum(f.size for f in flats) == sum(t.numel() for t in before.values())
    for p, flat in enumerate(flats):
        views.set(p, flat * 2)
    for n, t in model.named_parameters():
        assert torch.equal(t, before[n] * 2), n
    with pytest.raises(ConfigError, match="expected"):
        views.set(0, np.zeros(3, np.float32))
