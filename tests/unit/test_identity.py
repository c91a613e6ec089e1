"""Tests of the node identity: key file, libp2p peer id, and the one-node-per-identity lock."""

from __future__ import annotations

import logging
import os
import select
import signal
import stat
import subprocess
import sys
from pathlib import Path

import base58
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from atoll.protocol.errors import CodecError, ConfigError
from atoll.security.identity import (
    Identity,
    IdentityError,
    IdentityInUse,
    IdentityLock,
    _create,
    b58decode,
    b58encode,
    generate,
    load_or_create,
    peer_id_from_public_key,
    public_key_from_peer_id,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- peer ids ---------------------------------------------------------------------------------
def test_peer_id_is_libp2ps_own_derivation() -> None:
    for _ in range(5):
        identity = generate()
        pair = create_new_key_pair(identity.private_bytes())
        assert pair.public_key.to_bytes() == identity.public_key
        expected = ID.from_pubkey(pair.public_key).to_base58()
        assert identity.peer_id == expected
        assert identity.peer_id.startswith("12D3KooW")
        # and back: libp2p reads our id, we read libp2p's
        extracted = ID.from_base58(identity.peer_id).extract_public_key()
        assert extracted is not None and extracted.to_bytes() == identity.public_key
        assert public_key_from_peer_id(expected) == identity.public_key
        # a signature made with our key verifies with libp2p's
        assert pair.public_key.verify(b"hello", identity.sign(b"hello"))


def test_identity_from_seed_is_deterministic_and_hides_the_key() -> None:
    identity = generate()
    again = Identity.from_private_bytes(identity.private_bytes())
    assert again == identity and hash(again) == hash(identity)
    assert again.peer_id == peer_id_from_public_key(identity.public_key)
    assert len(identity.private_bytes()) == 32 and len(identity.public_key) == 32
    assert identity.private_bytes().hex() not in repr(identity)
    assert identity.peer_id in repr(identity)
    with pytest.raises(ConfigError):
        Identity.from_private_bytes(b"short")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "not0base58",
        "x" * 200,
        # a SHA-256 (RSA-style) peer id
        b58encode(b"\x12\x20" + bytes(range(32))),
        # a secp256k1 key inlined: protobuf Type=2, 33-byte key
        b58encode(bytes([0x00, 0x25, 0x08, 0x02, 0x12, 0x21]) + b"\x02" * 33),
        # an Ed25519 prefix with a short key
        b58encode(bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20]) + b"\x01" * 31),
    ],
)
def test_public_key_from_peer_id_refuses_other_ids(bad: str) -> None:
    with pytest.raises(CodecError):
        public_key_from_peer_id(bad)


def test_sha256_peer_id_error_says_why() -> None:
    with pytest.raises(CodecError, match="SHA-256"):
        public_key_from_peer_id(b58encode(b"\x12\x20" + bytes(32)))


@given(st.binary(max_size=80))
def test_base58_round_trip_matches_reference(data: bytes) -> None:
    text = b58encode(data)
    assert text == base58.b58encode(data).decode()
    assert b58decode(text) == data


@pytest.mark.parametrize("char", ["0", "O", "I", "l", "+", "é"])
def test_base58_refuses_characters_outside_the_alphabet(char: str) -> None:
    with pytest.raises(CodecError, match="base58"):
        b58decode("12D3" + char)


# -- the identity file -----------------------------------------------------------------------
def test_create_is_private_and_reload_gives_the_same_peer_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys" / "identity.pem"  # the parent does not exist yet
    with caplog.at_level(logging.INFO, logger="atoll.security.identity"):
        identity = load_or_create(path)
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700
    assert identity.peer_id in caplog.text
    assert load_or_create(path) == identity
    assert load_or_create(str(path)).peer_id == identity.peer_id
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert sorted(p.name for p in path.parent.iterdir()) == ["identity.pem"]  # no temp left


def test_create_ignores_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        load_or_create(tmp_path / "id.pem")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "id.pem") == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_file_others_can_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "id.pem"
    load_or_create(path)
    path.chmod(mode)
    with pytest.raises(IdentityError) as info:
        load_or_create(path)
    assert f"chmod 600 {path}" in str(info.value)


def _private_file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not a key at all\n",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        bytes(range(256)),
    ],
)
def test_garbage_file_is_refused_naming_the_path_and_left_alone(
    tmp_path: Path, content: bytes
) -> None:
    path = _private_file(tmp_path / "id.pem", content)
    with pytest.raises(IdentityError) as info:
        load_or_create(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == content


def test_key_of_another_type_is_refused(tmp_path: Path) -> None:
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path = _private_file(tmp_path / "id.pem", pem)
    with pytest.raises(IdentityError, match="Ed25519") as info:
        load_or_create(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == pem


def test_encrypted_key_is_refused(tmp_path: Path) -> None:
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    path = _private_file(tmp_path / "id.pem", pem)
    with pytest.raises(IdentityError, match="encrypted"):
        load_or_create(path)


def test_directory_at_the_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "id.pem"
    path.mkdir(mode=0o700)
    with pytest.raises(IdentityError, match="regular file"):
        load_or_create(path)


def test_existing_identity_is_never_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "id.pem"
    first = load_or_create(path)
    before = path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_ino
    for _ in range(3):
        assert load_or_create(path) == first
    assert (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_ino) == before


def test_creator_that_loses_the_race_keeps_the_winners_file(tmp_path: Path) -> None:
    # the file appears between load_or_create's first look and its write
    path = _private_file(tmp_path / "id.pem", generate().private_pem())
    winner = path.read_bytes()
    assert _create(path, generate().private_pem()) is False
    assert path.read_bytes() == winner
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id.pem"]


# -- the lock ---------------------------------------------------------------------------------
def test_second_lock_in_this_process_names_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "id.pem"
    with IdentityLock(path) as lock:
        assert lock.held
        with pytest.raises(IdentityInUse) as info:
            IdentityLock(path).acquire()
        assert info.value.pid == os.getpid()
        message = str(info.value)
        assert f"pid {os.getpid()}" in message and str(path) in message
        assert "give each node its own --identity" in message
    assert not lock.held
    with IdentityLock(path):  # released on exit
        pass


_HOLDER = (
    "import sys\n"
    "from atoll.security.identity import IdentityLock\n"
    "IdentityLock(sys.argv[1]).acquire()\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"  # hold until killed (or until the test's end closes stdin)
)


@pytest.mark.timeout(120)
def test_lock_held_by_another_process_until_it_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "id.pem"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready and proc.stdout.readline().strip() == "locked"
        with pytest.raises(IdentityInUse) as info:
            IdentityLock(path).acquire()
        assert info.value.pid == proc.pid
        assert f"pid {proc.pid}" in str(info.value)

        os.kill(proc.pid, signal.SIGKILL)  # no cleanup code runs: the kernel drops the lock
        assert proc.wait(timeout=30) == -signal.SIGKILL
        with IdentityLock(path) as lock:
            assert lock.held
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
