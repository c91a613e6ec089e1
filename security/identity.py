"""A node's persistent Ed25519 identity: the key file, the peer id, and the lock that keeps
two running nodes from sharing one identity.

A node is known to the swarm by its *peer id*, derived from its Ed25519 public key exactly
as libp2p derives it, so the id atoll checks signatures against is the id the libp2p host
shows on the wire::

    protobuf PublicKey{Type: Ed25519 (1), Data: 32 raw key bytes}   # 36 bytes
    -> identity multihash (code 0x00, length 36)                    # 38 bytes
    -> base58btc text                                               # "12D3KooW..."

Keys this small are inlined in the id (identity multihash) instead of hashed, so the
public key can be read back out of a peer id (:func:`public_key_from_peer_id`).

The private key lives in one file (PEM, PKCS8, unencrypted), created by
:func:`load_or_create` with mode 0600 and never overwritten. Users of other peer systems
copy one identity file to several machines and then see peers that flap between two
addresses; :class:`IdentityLock` catches that on one host (a second node started with the
same file fails at once with the holder's pid). Across hosts nothing local can notice a
copied file: that is for the swarm to detect.

This module uses ``cryptography`` only, not libp2p: the node layer hands
:meth:`Identity.private_bytes` to libp2p's own Ed25519 key type.

Errors::

    ConfigError (atoll.protocol.errors)
    └── IdentityError   the identity file is unreadable, open to other users, or malformed
        └── IdentityInUse  another running process holds the identity's lock
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
from pathlib import Path
from types import TracebackType

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from atoll.protocol.errors import CodecError, ConfigError

__all__ = [
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "Identity",
    "IdentityError",
    "IdentityInUse",
    "IdentityLock",
    "b58decode",
    "b58encode",
    "generate",
    "load_or_create",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
]

logger = logging.getLogger(__name__)

PUBLIC_KEY_BYTES: int = 32
"""Length of a raw Ed25519 public key (and of the private seed)."""

SIGNATURE_BYTES: int = 64
"""Length of an Ed25519 signature."""

# identity multihash header (code 0x00, digest length 36), then the protobuf PublicKey
# header: field 1 (Type) varint = 1 (Ed25519), field 2 (Data) length-delimited, 32 bytes
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
_PEER_ID_BYTES = len(_PEER_ID_PREFIX) + PUBLIC_KEY_BYTES
_PEER_ID_MAX_CHARS = 64  # an Ed25519 peer id is 52 characters; bound the decoding work

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}

_MAX_KEY_FILE_BYTES = 64 * 1024  # an Ed25519 PKCS8 PEM is 119 bytes
_FILE_MODE = 0o600
_DIR_MODE = 0o700


class IdentityError(ConfigError):
    """The identity file cannot be used: unreadable, readable by others, malformed, or not
    an Ed25519 key. The message names the file and says what to do."""


class IdentityInUse(IdentityError):
    """Another running process already holds this identity's lock.

    ``path`` is the identity file and ``pid`` the holder's process id as it wrote it into
    the lock file (``None`` when it could not be read).
    """

    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(
            f"another atoll node ({holder}) is already running with identity {path}; "
            "give each node its own --identity"
        )
        self.path = path
        self.pid = pid


# -- base58btc ------------------------------------------------------------------------------
def b58encode(data: bytes) -> str:
    """``data`` in base58btc (the Bitcoin alphabet), as libp2p writes peer ids.

    Each leading zero byte becomes a leading ``"1"``. The work is quadratic in the length,
    which is fine for ids and keys, not for bulk data.
    """
    zeros = len(data) - len(data.lstrip(b"\0"))
    n = int.from_bytes(data, "big")
    digits = []
    while n:
        n, r = divmod(n, 58)
        digits.append(_B58_ALPHABET[r])
    return "1" * zeros + "".join(reversed(digits))


def b58decode(text: str) -> bytes:
    """The bytes that :func:`b58encode` turned into ``text``.

    Raises :class:`~atoll.protocol.errors.CodecError` on a character outside the base58btc
    alphabet (which has no ``0``, ``O``, ``I`` or ``l``).
    """
    n = 0
    for pos, c in enumerate(text):
        digit = _B58_INDEX.get(c)
        if digit is None:
            raise CodecError(f"{c!r} at position {pos} is not a base58btc character")
        n = n * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return b"\0" * zeros + body


# -- peer ids ----------------------------------------------------------------------------------
def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58btc text, ``"12D3KooW..."``) of a raw Ed25519 public key."""
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        raise CodecError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes")
    return b58encode(_PEER_ID_PREFIX + public_key)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The raw 32-byte Ed25519 public key inlined in ``peer_id``.

    Only Ed25519 ids in the identity-multihash form (what :func:`peer_id_from_public_key`
    and libp2p produce for Ed25519) carry their key; anything else (an RSA or secp256k1
    id, a hashed ``Qm...`` id, a CID, garbage) raises
    :class:`~atoll.protocol.errors.CodecError` saying why.
    """
    if not isinstance(peer_id, str):
        raise CodecError(f"a peer id is str, not {type(peer_id).__name__}")
    if not peer_id or len(peer_id) > _PEER_ID_MAX_CHARS:
        raise CodecError(f"peer id of {len(peer_id)} characters is not an Ed25519 peer id")
    try:
        raw = b58decode(peer_id)
    except CodecError as e:
        raise CodecError(f"peer id {peer_id!r} is not base58btc: {e}") from None
    if raw[:2] == b"\x12\x20":
        raise CodecError(
            f"peer id {peer_id!r} is a SHA-256 hash of its key (RSA or other large key), "
            "not an Ed25519 peer id; its key cannot be recovered from it"
        )
    if len(raw) != _PEER_ID_BYTES or not raw.startswith(_PEER_ID_PREFIX):
        raise CodecError(
            f"peer id {peer_id!r} is not an inlined Ed25519 key "
            "(expected identity multihash of protobuf PublicKey{Type: Ed25519})"
        )
    return raw[len(_PEER_ID_PREFIX) :]


# -- the identity -----------------------------------------------------------------------------
class Identity:
    """A node's Ed25519 key pair and the libp2p peer id derived from it.

    Immutable. Two identities are equal when their public keys are. The private key never
    appears in ``repr``; :meth:`private_bytes` is the one way out, meant for libp2p's
    ``Ed25519PrivateKey.from_bytes`` in the node layer.
    """

    __slots__ = ("_key", "_peer_id", "_public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise ConfigError(f"an Identity needs an Ed25519 key, not {type(private_key)}")
        self._key = private_key
        self._public_key = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._peer_id = peer_id_from_public_key(self._public_key)

    @classmethod
    def from_private_bytes(cls, seed: bytes) -> Identity:
        """The identity whose private key is the 32-byte Ed25519 ``seed``."""
        if not isinstance(seed, bytes) or len(seed) != PUBLIC_KEY_BYTES:
            raise ConfigError(f"an Ed25519 private key is a {PUBLIC_KEY_BYTES}-byte seed")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self._public_key

    @property
    def peer_id(self) -> str:
        """The libp2p peer id, base58btc (``"12D3KooW..."``)."""
        return self._peer_id

    def private_bytes(self) -> bytes:
        """The raw 32-byte private seed. Secret: hand it to libp2p, never log or send it."""
        return self._key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def private_pem(self) -> bytes:
        """The private key as unencrypted PEM PKCS8, the format of the identity file."""
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data`` exactly as given.

        A raw signature says nothing about what ``data`` is; anything sent to peers should
        be signed with :func:`atoll.security.signing.seal`, which binds it to a domain.
        """
        return self._key.sign(data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Identity):
            return NotImplemented
        return self._public_key == other._public_key

    def __hash__(self) -> int:
        return hash(self._public_key)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self._peer_id!r})"


def generate() -> Identity:
    """A fresh random identity held in memory only (tests, throwaway peers)."""
    return Identity(Ed25519PrivateKey.generate())


# -- the identity file ----------------------------------------------------------------------
def load_or_create(path: str | os.PathLike[str]) -> Identity:
    """The identity stored at ``path``, created there first if no file exists.

    Creating: the parent directory is made (mode 0700) if missing; the key is written to
    a temporary file in that directory (``O_EXCL``, mode 0600), flushed to disk, then
    hard-linked to ``path``. Unlike a rename, a link fails when ``path`` appeared in the
    meantime, so two nodes starting at once never replace each other's key: the loser
    loads the winner's file. The new peer id is logged.

    Loading: the file must be a regular file that neither group nor others may access
    (else :class:`IdentityError` says ``chmod 600 PATH``) and must hold an unencrypted
    PEM PKCS8 Ed25519 private key (else :class:`IdentityError` naming the path). An
    existing file is never modified.
    """
    p = Path(path)
    try:
        return _load(p)
    except FileNotFoundError:
        pass
    identity = generate()
    if _create(p, identity.private_pem()):
        logger.info("created identity file %s for peer %s", p, identity.peer_id)
        return identity
    try:
        return _load(p)  # another process created it between our two looks: use theirs
    except FileNotFoundError:
        raise IdentityError(
            f"identity file {p} exists but cannot be opened (a dangling symlink?)"
        ) from None


def _load(p: Path) -> Identity:
    """Read and check the key file; FileNotFoundError when there is none."""
    try:
        # O_NONBLOCK: opening a FIFO planted at the path must not hang the node
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise IdentityError(f"cannot open identity file {p}: {e.strerror}") from None
    try:
        # check the file we opened, not the path, so a swap in between cannot fool us
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IdentityError(f"identity file {p} is not a regular file")
        if st.st_mode & 0o077:
            raise IdentityError(
                f"identity file {p} can be accessed by other users "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); it holds this node's private key. "
                f"Run: chmod 600 {p}"
            )
        data = os.read(fd, _MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise IdentityError(f"cannot read identity file {p}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise IdentityError(f"identity file {p} is too large to be an Ed25519 key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # cryptography's way to say the key is encrypted
        raise IdentityError(
            f"identity file {p} holds an encrypted key; atoll needs an unencrypted "
            "PEM PKCS8 Ed25519 key (protect it with file permissions)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise IdentityError(
            f"identity file {p} is not a PEM PKCS8 private key; move it away to let atoll "
            "create a new identity, or point --identity at the right file"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(
            f"identity file {p} holds a {type(key).__name__}, but atoll identities are Ed25519 keys"
        )
    return Identity(key)


def _create(p: Path, pem: bytes) -> bool:
    """Write ``pem`` to ``p`` unless it exists; False when another file got there first."""
    try:
        p.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    except OSError as e:
        raise IdentityError(f"cannot create directory {p.parent}: {e.strerror}") from None
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                _FILE_MODE,
            )
        except OSError as e:
            raise IdentityError(f"cannot create identity file {p}: {e.strerror}") from None
        try:
            os.fchmod(fd, _FILE_MODE)  # the umask may have taken bits away; set it exactly
            view = memoryview(pem)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, p)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise IdentityError(f"cannot create identity file {p}: {e.strerror}") from None
            # a filesystem without hard links: rename, which replaces a file that appears
            # between this check and the rename (a window of microseconds, same user)
            if os.path.lexists(p):
                return False
            os.rename(tmp, p)
        _fsync_dir(p.parent)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _fsync_dir(directory: Path) -> None:
    """Make a new directory entry durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


# -- one node per identity -------------------------------------------------------------------
class IdentityLock:
    """An exclusive lock on an identity for as long as a node runs with it.

    ``with IdentityLock(path):`` takes a non-blocking ``flock`` on ``PATH.lock`` and writes
    this process's pid into it. A second holder (another process, or another
    ``IdentityLock`` in this one) gets :class:`IdentityInUse` naming the path and the
    holder's pid. The kernel drops the lock when the holder closes it or dies in any way,
    ``kill -9`` included, so a stale lock file never blocks a restart; the file itself is
    left in place (deleting it would let two processes lock two different files).

    A child made with ``fork`` shares the lock while it lives; one started with ``spawn``
    (the network process) does not inherit it (the descriptor is close-on-exec).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`IdentityInUse` at once if someone holds it."""
        if self._fd is not None:
            raise RuntimeError(f"{self.lock_path} is already held by this IdentityLock")
        try:
            self.lock_path.parent.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
            fd = os.open(
                self.lock_path,
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                _FILE_MODE,
            )
        except OSError as e:
            raise IdentityError(f"cannot open lock file {self.lock_path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise IdentityInUse(self.path, pid) from None
        except OSError as e:
            os.close(fd)
            raise IdentityError(f"cannot lock {self.lock_path}: {e.strerror}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # the lock holds without the pid; only the message loses it
            logger.warning("could not write pid into %s: %s", self.lock_path, e.strerror)
        self._fd = fd
        logger.debug("locked identity %s (%s)", self.path, self.lock_path)

    def release(self) -> None:
        """Give the lock up (nothing happens when it is not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a pid left behind would name a process that let go
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> IdentityLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"IdentityLock({str(self.path)!r}, held={self.held})"


def _read_pid(fd: int) -> int | None:
    """The pid the holder wrote into the lock file, if it is there yet."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None
