"""Tests of the run manifest: validation, TOML round trip and the run id."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from atoll.protocol.engine import EngineConfig
from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import (
    MANIFEST_VERSION,
    GroupSettings,
    MembershipSettings,
    RobustSettings,
    RunManifest,
    Timeouts,
    short_id,
)

# a valid value different from the default, for every field
CHANGED_TOP: dict[str, Any] = {
    "name": "other-run",
    "model": "small",
    "data": "corpus.txt",
    "corpus_sha256": "ab" * 32,
    "seed": 1,
    "batch_size": 32,
    "batching": "documents",
    "lr": 1e-3,
    "warmup": 100,
    "total_steps": 5000,
    "min_lr_ratio": 0.05,
    "H": 50,
    "blocks_per_fragment": 1,
    "extras": "first",
    "owner": "12D3KooWEhEp2xFoSRFxbcfJQWqcfxwqM44MizWbBey19ctVX25H",
    "tau": 2,
    "alpha": 0.25,
    "codec": "int8",
    "codec_block": 64,
    "outer_lr": 0.5,
    "outer_momentum": 0.8,
    "nesterov": False,
    "error_feedback": True,
    "aggregation": "rda",
}
CHANGED_GROUP: dict[str, Any] = {"min_quorum": 3, "max_size": 16, "grace_s": 1.5}
CHANGED_TIMEOUTS: dict[str, Any] = {
    "dial_s": 5.0,
    "matchmaking_s": 20.0,
    "part_s": 25.0,
    "round_s": 90.0,
    "apply_wait_s": 1.0,
}

FULL_TOML = """
name = "demo"
model = "micro"
data = "stdlib"
seed = 7
lr = 1          # an int for a float is fine
H = 40
tau = 0
alpha = 0.0
codec = "E3M0"
codec_block = 64

[group]
min_quorum = 1
max_size = 4
grace_s = 0

[timeouts]
round_s = 60
"""


def base() -> RunManifest:
    return RunManifest(name="demo")


def test_defaults_are_valid() -> None:
    m = base()
    assert m.group == GroupSettings()
    assert m.timeouts == Timeouts()
    assert len(m.run_id()) == 64
    assert all(c in "0123456789abcdef" for c in m.run_id())
    assert short_id(m.run_id()) == m.run_id()[:12]
    assert MANIFEST_VERSION >= 1


def test_every_field_is_covered_by_the_change_tables() -> None:
    top = {f.name for f in dataclasses.fields(RunManifest)} - {
        "group",
        "timeouts",
        "membership",
        "robust",
    }
    assert set(CHANGED_TOP) == top
    assert set(CHANGED_GROUP) == {f.name for f in dataclasses.fields(GroupSettings)}
    assert set(CHANGED_TIMEOUTS) == {f.name for f in dataclasses.fields(Timeouts)}


def test_toml_round_trip_is_equal_with_the_same_id() -> None:
    m = RunManifest.from_toml(FULL_TOML)
    assert m.codec == "e3m0"  # normalised
    assert m.lr == 1.0 and isinstance(m.lr, float)
    assert m.group == GroupSettings(min_quorum=1, max_size=4, grace_s=0.0)
    assert m.timeouts.round_s == 60.0 and m.timeouts.dial_s == 10.0
    text = m.to_toml()
    again = RunManifest.from_toml(text)
    assert again == m
    assert again.run_id() == m.run_id()
    assert again.to_toml() == text


def test_round_trip_of_awkward_strings_and_floats() -> None:
    m = RunManifest(
        name='a "quoted" \\ run é',
        data="a.txt,b.jsonl",
        lr=1.2345678901234567e-07,
        min_lr_ratio=1 / 3,
        timeouts=Timeouts(dial_s=1e-3, round_s=1e16, part_s=1e15),
    )
    again = RunManifest.from_toml(m.to_toml())
    assert again == m and again.run_id() == m.run_id()


def test_every_field_change_changes_the_run_id() -> None:
    m = base()
    ids = {m.run_id()}
    for key, value in CHANGED_TOP.items():
        ids.add(dataclasses.replace(m, **{key: value}).run_id())
    for key, value in CHANGED_GROUP.items():
        ids.add(dataclasses.replace(m, group=dataclasses.replace(m.group, **{key: value})).run_id())
    for key, value in CHANGED_TIMEOUTS.items():
        timeouts = dataclasses.replace(m.timeouts, **{key: value})
        ids.add(dataclasses.replace(m, timeouts=timeouts).run_id())
    assert len(ids) == 1 + len(CHANGED_TOP) + len(CHANGED_GROUP) + len(CHANGED_TIMEOUTS)


def test_equal_values_give_equal_ids_whatever_the_spelling() -> None:
    a = RunManifest.from_toml('name = "x"\nlr = 1\ncodec = "E3M0"\n[group]\ngrace_s = -0.0\n')
    b = RunManifest(name="x", lr=1.0, codec="e3m0", group=GroupSettings(grace_s=0.0))
    assert a == b and a.run_id() == b.run_id()
    upper = RunManifest(name="x", corpus_sha256="AB" * 32)
    assert upper.corpus_sha256 == "ab" * 32
    assert upper.run_id() == RunManifest(name="x", corpus_sha256="ab" * 32).run_id()
    # the order of keys and tables in the file does not matter
    c = RunManifest.from_toml('name = "x"\n[group]\nmax_size = 4\n[timeouts]\ndial_s = 3\n')
    d = RunManifest.from_toml('name = "x"\n[timeouts]\ndial_s = 3\n[group]\nmax_size = 4\n')
    assert c == d and c.run_id() == d.run_id()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('name = "x"\nlearning_rate = 0.1\n', "'learning_rate'; known keys: name, model"),
        ('name = "x"\nwarmpu = 3\n', "unknown key 'warmpu'; did you mean 'warmup'"),
        (
            'name = "x"\n[group]\nmin_quorm = 3\n',
            "'group.min_quorm'; did you mean 'group.min_quorum'",
        ),
        ('name = "x"\n[timeouts]\nround = 3\n', "did you mean 'timeouts.round_s'"),
        ('name = "x"\ndial_s = 3\n', "'dial_s'; it belongs in the \\[timeouts\\] table"),
        ('name = "x"\n[group]\ncodec = "fp32"\n', "'codec' is a top-level key"),
    ],
)
def test_unknown_keys_name_the_closest_known_key(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        RunManifest.from_toml(text, source="run.toml")
    assert str(info.value).startswith("run.toml: ")


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("H = 1.5", "H must be an integer, not a float 1.5"),
        ("H = true", "H must be an integer, not a boolean"),
        ('lr = "fast"', "lr must be a number, not a string"),
        ("alpha = false", "alpha must be a number, not a boolean"),
        ("nesterov = 1", "nesterov must be true or false, not an integer 1"),
        ("codec = 4", "codec must be a string"),
        ("seed = [1]", "seed must be an integer, not an array"),
        ("group = 3", "group must be a table"),
        ("H = { a = 1 }", "H must be a value, not a table"),
        ("[timeouts]\ndial_s = '1'", "timeouts.dial_s must be a number, not a string"),
        ("[group]\nmax_size = 2.0", "group.max_size must be an integer"),
        ("lr = nan", "lr must be a finite number"),
        ("lr = inf", "lr must be a finite number"),
        ("seed = 9223372036854775808", "seed is out of the 64-bit integer range"),
    ],
)
def test_wrong_types_name_the_key_and_the_source(line: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", "\\[")) as info:
        RunManifest.from_toml(f'name = "x"\n{line}\n', source="/etc/atoll/run.toml")
    assert str(info.value).startswith("/etc/atoll/run.toml: ")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"name": ""}, "name must not be empty"),
        ({"name": "   "}, "name must not be empty"),
        ({"name": "x" * 101}, "at most 100"),
        ({"name": " x"}, "whitespace"),
        ({"name": "a\nb"}, "non-printable"),
        ({"model": ""}, "model must not be empty"),
        ({"corpus_sha256": "abc"}, "corpus_sha256"),
        ({"corpus_sha256": "g" * 64}, "corpus_sha256"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"batch_size": 0}, "batch_size"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"warmup": -1}, "warmup"),
        ({"total_steps": 0}, "total_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"H": 0}, "H must be >= 1"),
        ({"tau": 100}, "tau must be in"),
        ({"tau": -1}, "tau must be in"),
        ({"alpha": 1.5}, "alpha must be in"),
        ({"alpha": -0.1}, "alpha must be in"),
        ({"blocks_per_fragment": 0}, "blocks_per_fragment"),
        ({"extras": "middle"}, "extras must be one of"),
        ({"codec": "fp8"}, "codec = 'fp8'.*unknown codec"),
        ({"codec_block": 0}, "codec_block must be >= 1"),
        ({"codec_block": 3}, "codec = 'e3m0', codec_block = 3"),
        ({"aggregation": "median"}, "aggregation must be one of"),
        ({"outer_lr": -1.0}, "outer_lr must be > 0"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"group": GroupSettings(grace_s=20.0)}, "grace_s .* must be < timeouts.matchmaking_s"),
        ({"group": {"min_quorum": 2}}, "group must be a GroupSettings"),
    ],
)
def test_out_of_range_values_are_refused(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        RunManifest(**{"name": "x", **changes})


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"min_quorum": 0}, "group.min_quorum must be >= 1"),
        ({"max_size": 1, "min_quorum": 1}, "group.max_size must be >= 2"),
        ({"min_quorum": 9}, "group.min_quorum \\(9\\) must be <= group.max_size \\(8\\)"),
        ({"grace_s": -1.0}, "group.grace_s must be >= 0"),
        ({"max_size": True}, "group.max_size must be an integer"),
    ],
)
def test_group_settings_ranges(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        GroupSettings(**kwargs)


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(Timeouts)])
def test_timeouts_must_be_positive(key: str) -> None:
    with pytest.raises(ConfigError, match=f"timeouts.{key} must be > 0"):
        Timeouts(**{key: 0.0})
    with pytest.raises(ConfigError, match=f"{key}.* must be > 0"):
        RunManifest.from_toml(f'name = "x"\n[timeouts]\n{key} = -1\n', source="m.toml")


def test_a_phase_cannot_outlast_its_round() -> None:
    with pytest.raises(ConfigError, match=r"part_s .* must be <= timeouts.round_s"):
        Timeouts(part_s=60.0, round_s=30.0)


def test_min_quorum_of_one_is_allowed() -> None:
    assert GroupSettings(min_quorum=1).min_quorum == 1


def test_invalid_toml_and_missing_name() -> None:
    with pytest.raises(ConfigError, match=r"^m.toml: not valid TOML"):
        RunManifest.from_toml("name = = 3", source="m.toml")
    with pytest.raises(ConfigError, match=r"^m.toml: the required key 'name' is missing"):
        RunManifest.from_toml("", source="m.toml")
    with pytest.raises(ConfigError, match="TOML text"):
        RunManifest.from_toml(b'name = "x"')  # type: ignore[arg-type]


def test_load_reads_a_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(base().to_toml(), encoding="utf-8")
    assert RunManifest.load(path) == base()
    assert RunManifest.load(str(path)).run_id() == base().run_id()
    path.write_text('name = "x"\nH = 0\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}: H must be >= 1")):
        RunManifest.load(path)


def test_load_of_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"run manifest not found: .*nope.toml"):
        RunManifest.load(missing)
    with pytest.raises(ConfigError, match="cannot read run manifest"):
        RunManifest.load(tmp_path)  # a folder


def test_engine_config_matches() -> None:
    m = dataclasses.replace(
        base(),
        **{k: CHANGED_TOP[k] for k in ("H", "tau", "alpha", "codec", "codec_block", "outer_lr")},
        **{k: CHANGED_TOP[k] for k in ("outer_momentum", "nesterov", "error_feedback")},
        aggregation="rda",
    )
    assert m.engine_config() == EngineConfig(
        H=50,
        tau=2,
        alpha=0.25,
        outer_lr=0.5,
        outer_momentum=0.8,
        nesterov=False,
        codec="int8",
        codec_block=64,
        error_feedback=True,
        aggregation="rda",
    )
    d = base().engine_config()
    assert (d.H, d.tau, d.alpha, d.codec, d.codec_block) == (100, 1, 0.5, "e3m0", 128)
    assert (d.outer_lr, d.outer_momentum, d.nesterov) == (0.7, 0.9, True)


def test_short_id() -> None:
    assert short_id("0123456789abcdef" * 4) == "0123456789ab"
    with pytest.raises(ConfigError):
        short_id(None)  # type: ignore[arg-type]


# -- [membership] ---------------------------------------------------------------------------
PEER_A = "12D3KooWEhEp2xFoSRFxbcfJQWqcfxwqM44MizWbBey19ctVX25H"
PEER_B = "12D3KooWBQ7UoSFywWj1g7eUaGrsWkbyt9SFnR8gc4LqhGHuC953"
ORG_KEY = "1c65273e9ac92b4d125e7303a7b8d0c05ba2f26d1762127e668feb8f96ab54e8"


def test_a_manifest_without_membership_keeps_its_run_id() -> None:
    # computed with the manifest code before [membership] existed: must never change
    assert RunManifest(name="x").run_id() == (
        "aa4754755ebc1f91065ddeccf80bf42e0a52366552c8c432b4a0472e9b22bbcf"
    )
    explicit = RunManifest.from_toml('name = "x"\n[membership]\nmode = "public"\n')
    assert explicit.run_id() == RunManifest(name="x").run_id()
    assert "[membership]" not in RunManifest(name="x").to_toml()


def test_membership_changes_the_run_id_and_round_trips() -> None:
    tables = [
        MembershipSettings(mode="private", allowlist=(PEER_A,)),
        MembershipSettings(mode="private", allowlist=(PEER_A, PEER_B)),
        MembershipSettings(mode="private", org_key=ORG_KEY),
        MembershipSettings(mode="private", org_key=ORG_KEY, revoked=(PEER_B,)),
        MembershipSettings(mode="private", org_key=ORG_KEY, revoked=("ab" * 32,)),
        MembershipSettings(revoked=(PEER_B,)),
    ]
    ids = {base().run_id()}
    for table in tables:
        m = dataclasses.replace(base(), membership=table)
        ids.add(m.run_id())
        again = RunManifest.from_toml(m.to_toml())
        assert again == m and again.run_id() == m.run_id()
    assert len(ids) == 1 + len(tables)


def test_membership_normal_form() -> None:
    a = MembershipSettings(
        mode="private", allowlist=[PEER_B, PEER_A, PEER_A], org_key=ORG_KEY.upper()
    )
    b = MembershipSettings(mode="private", allowlist=(PEER_A, PEER_B), org_key=ORG_KEY)
    assert a == b and a.allowlist == tuple(sorted((PEER_A, PEER_B)))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('mode = "secret"', "membership.mode must be one of"),
        ('mode = "private"', "needs an allowlist, an org_key or both"),
        (f'allowlist = ["{PEER_A}"]', "need membership.mode = 'private'"),
        ('mode = "private"\nallowlist = ["not-a-peer"]', "is not an Ed25519 peer id"),
        ('mode = "private"\nallowlist = "x"', "must be an array of peer ids"),
        ('mode = "private"\nallowlist = [1]', "is not a string"),
        ('mode = "private"\norg_key = "abc"', "must be 64 hex digits"),
        ('revoked = ["zz"]', "neither a peer id nor a certificate id"),
        ("mode = 1", "must be a string"),
        ('modes = "private"', "did you mean 'membership.mode'"),
    ],
)
def test_bad_membership_tables_are_refused(table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunManifest.from_toml(f'name = "x"\n[membership]\n{table}\n')


# -- [robust] -------------------------------------------------------------------------------
def test_a_manifest_without_robust_keeps_its_run_id_and_the_table_changes_it() -> None:
    plain = RunManifest(name="x")
    assert plain.run_id() == "aa4754755ebc1f91065ddeccf80bf42e0a52366552c8c432b4a0472e9b22bbcf"
    explicit = RunManifest.from_toml('name = "x"\n[robust]\nrule = "mean"\n')
    assert explicit.run_id() == plain.run_id() and "[robust]" not in plain.to_toml()
    tables = [
        RobustSettings(rule="trimmed_mean"),
        RobustSettings(rule="trimmed_mean", trim=0.4),
        RobustSettings(rule="centered_clip", clip_scale=1.5, iterations=5),
        RobustSettings(checks=True),
        RobustSettings(checks=True, norm_factor=4.0, weight_factor=3.0),
        RobustSettings(verify_owners=True),
    ]
    ids = {base().run_id()}
    for table in tables:
        m = dataclasses.replace(base(), robust=table)
        ids.add(m.run_id())
        again = RunManifest.from_toml(m.to_toml())
        assert again == m and again.run_id() == m.run_id()
    assert len(ids) == 1 + len(tables)
    rule = RobustSettings(rule="centered_clip", clip_scale=1.5).to_rule()
    assert rule.kind == "centered_clip" and rule.clip_scale == 1.5
    assert RobustSettings().to_checks() is None
    checks = RobustSettings(checks=True, norm_factor=4.0).to_checks()
    assert checks is not None and checks.norm_factor == 4.0


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('rule = "median"', "robust: "),
        ("trim = 0.9", "robust: "),
        ("clip_scale = -1.0", "robust: "),
        ("iterations = 0", "robust: "),
        ("norm_factor = 0.5", "robust: "),
        ('checks = "yes"', "robust.checks"),
        ("rules = 1", "did you mean 'robust.rule'"),
    ],
)
def test_bad_robust_tables_are_refused(table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunManifest.from_toml(f'name = "x"\n[robust]\n{table}\n')


# -- owner ----------------------------------------------------------------------------------
ORG_RUN = (
    'name = "org-run"\nH = 50\ncodec = "e3m0"\n[membership]\nmode = "private"\n'
    f'allowlist = ["{PEER_A}"]\n[robust]\nrule = "trimmed_mean"\n'
)


def test_a_manifest_without_an_owner_keeps_its_run_id_and_toml() -> None:
    # computed with the manifest code before the owner key existed (and after the
    # [robust] table gained verify_owners): must never change
    m = RunManifest.from_toml(ORG_RUN)
    assert m.run_id() == "bf505035b5fc3d0dc85dbaafb66cab801af122b9a9cf8c7fea13db2c51eaf316"
    assert RunManifest(name="x").run_id() == (
        "aa4754755ebc1f91065ddeccf80bf42e0a52366552c8c432b4a0472e9b22bbcf"
    )
    assert not any(line.startswith("owner") for line in m.to_toml().splitlines())
    explicit = RunManifest.from_toml('owner = ""\n' + ORG_RUN)
    assert explicit == m and explicit.run_id() == m.run_id()


def test_the_owner_changes_the_run_id_and_round_trips() -> None:
    plain = RunManifest.from_toml(ORG_RUN)
    owned = RunManifest.from_toml(f'owner = "{PEER_B}"\n' + ORG_RUN)
    other = dataclasses.replace(plain, owner=PEER_A)
    assert owned.owner == PEER_B
    assert len({plain.run_id(), owned.run_id(), other.run_id()}) == 3
    again = RunManifest.from_toml(owned.to_toml())
    assert again == owned and again.run_id() == owned.run_id()
    assert f'owner = "{PEER_B}"' in owned.to_toml()


@pytest.mark.parametrize("owner", ["alice", "ab" * 32, PEER_A[:-1], 7])
def test_an_owner_that_is_not_a_peer_id_is_refused(owner: object) -> None:
    value = f'"{owner}"' if isinstance(owner, str) else str(owner)
    with pytest.raises(ConfigError, match="owner"):
        RunManifest.from_toml(f'name = "x"\nowner = {value}\n')


# -- batching ---------------------------------------------------------------------------------
def test_windows_batching_keeps_the_run_id_and_documents_change_it() -> None:
    plain = RunManifest.from_toml(ORG_RUN)
    explicit = RunManifest.from_toml('batching = "windows"\n' + ORG_RUN)
    assert explicit == plain and explicit.run_id() == plain.run_id()
    assert plain.run_id() == "bf505035b5fc3d0dc85dbaafb66cab801af122b9a9cf8c7fea13db2c51eaf316"
    assert "batching" not in plain.to_toml()
    docs = RunManifest.from_toml('batching = "documents"\n' + ORG_RUN)
    assert docs.batching == "documents" and docs.run_id() != plain.run_id()
    assert 'batching = "documents"' in docs.to_toml()
    again = RunManifest.from_toml(docs.to_toml())
    assert again == docs and again.run_id() == docs.run_id()


@pytest.mark.parametrize("value", ['"document"', '"Windows"', "1"])
def test_an_unknown_batching_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="batching"):
        RunManifest.from_toml(f'name = "x"\nbatching = {value}\n')
