"""Signed run manifests: the owner signs the run id, a joiner checks it (and the CLI)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import RunManifest
from atoll.security.identity import generate
from atoll.security.manifest_sig import (
    MANIFEST_DOMAIN,
    MAX_SIGNATURE_FILE_BYTES,
    ManifestSignatureError,
    check_manifest_signature,
    signature_path,
    signature_text,
    verify_signature_text,
    write_signature,
)
from atoll.security.signing import seal

OWNER = generate()
OTHER = generate()
TEXT = 'name = "signed-run"\nH = 50\n'


def _owned(owner: str = OWNER.peer_id) -> RunManifest:
    return RunManifest.from_toml(f'owner = "{owner}"\n' + TEXT)


def _write(tmp_path: Path, manifest: RunManifest) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(manifest.to_toml())
    return path


def _sig_line(envelope_bytes: bytes) -> str:
    return f"# a comment\n{envelope_bytes.hex()}\n"


# -- signing and checking -------------------------------------------------------------------
def test_the_owner_signs_and_a_joiner_accepts(tmp_path: Path) -> None:
    manifest = _owned()
    path = _write(tmp_path, manifest)
    sig = write_signature(OWNER, manifest, path)
    assert sig == signature_path(path) == tmp_path / "run.toml.sig"
    check = check_manifest_signature(RunManifest.load(path), path)
    assert check.signer == OWNER.peer_id and check.owner == OWNER.peer_id
    assert check.describe().startswith(f"manifest signed by its owner {OWNER.peer_id}")
    assert manifest.run_id() in sig.read_text()  # the comment says what was signed


def test_the_signature_holds_for_another_spelling_of_the_same_settings(tmp_path: Path) -> None:
    manifest = _owned()
    path = _write(tmp_path, manifest)
    write_signature(OWNER, manifest, path)
    # comments, key order and 50 vs 50.0 style changes keep the run id, so the signature
    path.write_text(f'# edited by hand\nH = 50\nowner = "{OWNER.peer_id}"\nname = "signed-run"\n')
    assert check_manifest_signature(RunManifest.load(path), path).signer == OWNER.peer_id


def test_a_manifest_naming_an_owner_without_a_signature_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, _owned())
    with pytest.raises(ManifestSignatureError, match=r"names owner .* but has no signature"):
        check_manifest_signature(_owned(), path)
    assert isinstance(ManifestSignatureError("x"), ConfigError)


def test_a_changed_manifest_voids_the_signature(tmp_path: Path) -> None:
    manifest = _owned()
    path = _write(tmp_path, manifest)
    write_signature(OWNER, manifest, path)
    changed = dataclasses.replace(manifest, lr=1e-2)
    with pytest.raises(ManifestSignatureError, match="changed after it was signed"):
        check_manifest_signature(changed, path)


def test_a_signature_by_another_key_is_refused(tmp_path: Path) -> None:
    manifest = _owned()
    path = _write(tmp_path, manifest)
    with pytest.raises(ManifestSignatureError, match="this key is"):
        write_signature(OTHER, manifest, path)  # the tool refuses to make it
    forged = seal(OTHER, MANIFEST_DOMAIN, manifest.run_id().encode())
    signature_path(path).write_text(_sig_line(forged.to_bytes()))
    with pytest.raises(ManifestSignatureError, match=f"signed by {OTHER.peer_id}, not by"):
        check_manifest_signature(manifest, path)


def test_a_signature_for_another_domain_or_a_bad_signature_is_refused(tmp_path: Path) -> None:
    manifest = _owned()
    run_id = manifest.run_id().encode()
    other_domain = seal(OWNER, "atoll/peer-record/v1", run_id)
    with pytest.raises(ManifestSignatureError, match="domain"):
        verify_signature_text(manifest, _sig_line(other_domain.to_bytes()))
    good = seal(OWNER, MANIFEST_DOMAIN, run_id)
    broken = dataclasses.replace(good, signature=bytes(64))
    with pytest.raises(ManifestSignatureError, match="does not verify"):
        verify_signature_text(manifest, _sig_line(broken.to_bytes()))
    assert verify_signature_text(manifest, _sig_line(good.to_bytes())) == OWNER.peer_id


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "found 0"),
        ("# only comments\n", "found 0"),
        ("abcd\nef01\n", "found 2"),
        ("not hex\n", "not a signature"),
        ("93\n", "not a signature"),
        ("dd" + "ffffffff" + "\n", "not a signature"),  # a msgpack bomb header
    ],
)
def test_malformed_signature_files_are_refused(text: str, expected: str) -> None:
    with pytest.raises(ManifestSignatureError, match=expected):
        verify_signature_text(_owned(), text)


def test_an_oversized_or_binary_signature_file_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, _owned())
    signature_path(path).write_bytes(b"a" * (MAX_SIGNATURE_FILE_BYTES + 1))
    with pytest.raises(ManifestSignatureError, match="over 4096 bytes"):
        check_manifest_signature(_owned(), path)
    signature_path(path).write_bytes(b"\xff\xfe")
    with pytest.raises(ManifestSignatureError, match="not text"):
        check_manifest_signature(_owned(), path)


def test_a_manifest_without_an_owner_needs_no_signature(tmp_path: Path) -> None:
    manifest = RunManifest.from_toml(TEXT)
    path = _write(tmp_path, manifest)
    check = check_manifest_signature(manifest, path)
    assert check.signer is None and check.describe().startswith("manifest not signed")
    # any key may sign it; the node says so, and that nothing required it
    write_signature(OTHER, manifest, path)
    check = check_manifest_signature(manifest, path)
    assert check.signer == OTHER.peer_id and "names no owner" in check.describe()
    # a signature present must still match: it says the manifest changed since
    with pytest.raises(ManifestSignatureError, match="changed after it was signed"):
        check_manifest_signature(dataclasses.replace(manifest, H=60), path)


def test_signature_text_is_one_hex_line_and_comments() -> None:
    text = signature_text(OWNER, _owned())
    data = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(data) == 1 and bytes.fromhex(data[0])
    assert len(text) < 1000


# -- the command line -----------------------------------------------------------------------
CLI = [sys.executable, "-m", "atoll.node.cli"]


def _atoll(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
def test_cli_sign_verify_and_a_node_refusing_an_unsigned_manifest(tmp_path: Path) -> None:
    key = tmp_path / "owner.key"
    done = _atoll("keygen", str(key))
    assert done.returncode == 0, done.stderr
    owner = dict(line.split(":", 1) for line in done.stdout.splitlines())["peer id"].strip()
    run = tmp_path / "run.toml"
    run.write_text(f'owner = "{owner}"\n' + TEXT)

    # a node refuses the owned manifest while it has no signature: one line, exit 2
    bad_identity = tmp_path / "node.key"
    bad_identity.write_text("not a key")
    os.chmod(bad_identity, 0o600)
    node = _atoll("node", "--run", str(run), "--identity", str(bad_identity))
    assert node.returncode == 2, node.stderr
    lines = node.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: run manifest "), lines
    assert "has no signature" in lines[0]

    done = _atoll("manifest", "sign", "--key", str(key), str(run))
    assert done.returncode == 0, done.stderr
    assert f"signed by: {owner}" in done.stdout and (tmp_path / "run.toml.sig").is_file()
    done = _atoll("manifest", "verify", str(run))
    assert done.returncode == 0 and "signed by its owner" in done.stdout, done.stderr

    # signed: the node says so and goes on (to the identity file, which stops it here)
    node = _atoll("node", "--run", str(run), "--identity", str(bad_identity))
    assert f"atoll node: manifest signed by its owner {owner}" in node.stderr, node.stderr
    assert "signature" not in node.stderr.splitlines()[-1]

    # another key cannot sign it, and a changed manifest is refused
    other = tmp_path / "other.key"
    assert _atoll("keygen", str(other)).returncode == 0
    done = _atoll("manifest", "sign", "--key", str(other), str(run))
    assert done.returncode == 2 and "this key is" in done.stderr
    run.write_text(f'owner = "{owner}"\n' + TEXT + "lr = 0.01\n")
    done = _atoll("manifest", "verify", str(run))
    assert done.returncode == 2 and "changed after it was signed" in done.stderr
