"""Signed run manifests: the run owner vouches for a manifest, a joiner checks it.

A manifest travels from its author to every joiner by whatever means they use (a chat, a
repository, a web page), and a node trains whatever run its manifest defines. A manifest
that names its owner (``owner = "12D3KooW..."``, the peer id of the owner's key) is only
trusted with the owner's signature next to it: ``atoll manifest sign --key OWNER_KEY
run.toml`` writes ``run.toml.sig``, and ``atoll node --run run.toml`` refuses to start
(one line, :class:`ManifestSignatureError`) when that file is missing, is for another
manifest, or was signed by anyone but the owner.

What is signed is the manifest's run id (:meth:`~atoll.protocol.manifest.RunManifest.run_id`,
a sha256 over the canonical encoding of every setting, the owner included), in a
:class:`~atoll.security.signing.SignedEnvelope` of domain :data:`MANIFEST_DOMAIN`. So the
signature holds for every spelling of the same settings (comments, key order, ``1`` for
``1.0``) and for nothing else: any change of a setting changes the run id and voids it.
The domain keeps the signature apart from anything else the owner's key signs.

The signature file is text: comment lines (``#``) saying what was signed, for a reader,
and one line of hex holding the envelope's bytes; only the hex counts. A manifest that
names no owner needs no signature; when one lies next to it anyway it must verify (a
signature that no longer matches means the manifest changed after it was signed), and the
node says who signed it, noting that nothing required it.

Errors::

    ConfigError (atoll.protocol.errors)
    └── ManifestSignatureError   the manifest's signature is missing, unreadable, for
                                 another manifest, or not by its owner
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from atoll.protocol.errors import CodecError, ConfigError
from atoll.protocol.manifest import RunManifest, short_id
from atoll.security.identity import Identity
from atoll.security.signing import BadSignature, SignedEnvelope, open_envelope, seal, signer_peer_id

__all__ = [
    "MANIFEST_DOMAIN",
    "MAX_SIGNATURE_FILE_BYTES",
    "SIGNATURE_SUFFIX",
    "ManifestSignatureError",
    "SignatureCheck",
    "check_manifest_signature",
    "signature_path",
    "signature_text",
    "verify_signature_text",
    "write_signature",
]

MANIFEST_DOMAIN: str = "atoll/run-manifest/v1"
"""The domain of a manifest signature's envelope."""

SIGNATURE_SUFFIX: str = ".sig"
"""A manifest's signature file is the manifest's path with this appended."""

MAX_SIGNATURE_FILE_BYTES: int = 4096
"""Largest signature file read (one is about 500 bytes)."""

_RUN_ID_BYTES = 64  # a run id: 64 lowercase hex digits


class ManifestSignatureError(ConfigError):
    """The run manifest's signature is missing, unreadable, for another manifest or not by
    the owner the manifest names: the node does not start."""


@dataclass(frozen=True, slots=True)
class SignatureCheck:
    """What :func:`check_manifest_signature` found (it raises when the manifest fails)."""

    signer: str | None
    """peer id of the key that signed the manifest; None: no signature file"""
    owner: str
    """the owner the manifest names ("" when none)"""
    path: Path
    """where the signature was looked for"""

    def describe(self) -> str:
        """One line for the operator: signed by whom, or not signed."""
        if self.signer is None:
            return f"manifest not signed (no owner named, no {self.path.name})"
        if self.owner:
            return f"manifest signed by its owner {self.signer} ({self.path.name})"
        return (
            f"manifest signed by {self.signer} ({self.path.name}); it names no owner, so "
            f"nothing required the signature"
        )


def signature_path(manifest_path: str | os.PathLike[str]) -> Path:
    """Where the signature of the manifest at ``manifest_path`` lives."""
    path = Path(manifest_path)
    return path.with_name(path.name + SIGNATURE_SUFFIX)


def signature_text(identity: Identity, manifest: RunManifest) -> str:
    """The signature file's text: ``manifest``'s run id signed by ``identity``.

    Raises :class:`ManifestSignatureError` when the manifest names an owner other than
    ``identity`` (that signature would never be accepted).
    """
    if manifest.owner and manifest.owner != identity.peer_id:
        raise ManifestSignatureError(
            f"the manifest names owner {manifest.owner}; this key is {identity.peer_id}"
        )
    run_id = manifest.run_id()
    envelope = seal(identity, MANIFEST_DOMAIN, run_id.encode("ascii"))
    return (
        "# atoll run manifest signature: only the hex line counts\n"
        f"# run {manifest.name!r}, run id {run_id}\n"
        f"# signed by {identity.peer_id}\n"
        f"{envelope.to_bytes().hex()}\n"
    )


def write_signature(
    identity: Identity,
    manifest: RunManifest,
    manifest_path: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
) -> Path:
    """Sign ``manifest`` (read from ``manifest_path``) and write the signature to ``out``
    (default: :func:`signature_path`, replaced if it exists); return where it went."""
    target = Path(out) if out is not None else signature_path(manifest_path)
    text = signature_text(identity, manifest)
    try:
        target.write_text(text, encoding="ascii")
    except OSError as e:
        raise ManifestSignatureError(
            f"cannot write the signature {target}: {e.strerror or e}"
        ) from None
    return target


def verify_signature_text(manifest: RunManifest, text: str, *, source: str = "signature") -> str:
    """The peer id that signed ``manifest`` in the signature file text ``text``.

    Raises :class:`ManifestSignatureError` when the text holds no envelope, the envelope
    is not a manifest signature, does not verify, signs another run id, or (when the
    manifest names an owner) was signed by another key.
    """
    lines = [line.strip() for line in text.splitlines()]
    data = [line for line in lines if line and not line.startswith("#")]
    if len(data) != 1:
        raise ManifestSignatureError(
            f"{source}: expected one line of hex (the signed envelope), found {len(data)}"
        )
    try:
        raw = bytes.fromhex(data[0])
        envelope = SignedEnvelope.from_bytes(raw, max_bytes=MAX_SIGNATURE_FILE_BYTES)
    except (ValueError, CodecError) as e:
        raise ManifestSignatureError(f"{source}: not a signature: {e}") from None
    owner = manifest.owner or None
    try:
        payload = open_envelope(
            envelope, domain=MANIFEST_DOMAIN, max_payload=_RUN_ID_BYTES, signer=owner
        )
    except BadSignature as e:
        if owner is not None and envelope.domain == MANIFEST_DOMAIN:
            claimed = signer_peer_id(envelope)
            if claimed != owner:
                raise ManifestSignatureError(
                    f"{source}: signed by {claimed}, not by the run's owner {owner}"
                ) from None
        raise ManifestSignatureError(f"{source}: {e}") from None
    run_id = manifest.run_id()
    if payload != run_id.encode("ascii"):
        signed = payload.decode("ascii", errors="replace")
        raise ManifestSignatureError(
            f"{source}: signs run id {short_id(signed)}, not this manifest's "
            f"{short_id(run_id)}: the manifest changed after it was signed"
        )
    return signer_peer_id(envelope)


def check_manifest_signature(
    manifest: RunManifest,
    manifest_path: str | os.PathLike[str],
    sig_path: str | os.PathLike[str] | None = None,
) -> SignatureCheck:
    """Check the signature of ``manifest`` (read from ``manifest_path``) as a joiner does.

    The signature is read from ``sig_path`` (default: :func:`signature_path`). A manifest
    naming an owner needs a valid signature by that owner; one naming none needs none,
    but a signature present must verify. Raises :class:`ManifestSignatureError` with one
    line saying what is wrong and what to do.
    """
    path = Path(sig_path) if sig_path is not None else signature_path(manifest_path)
    owner = manifest.owner
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_SIGNATURE_FILE_BYTES + 1)
    except FileNotFoundError:
        if owner:
            raise ManifestSignatureError(
                f"run manifest {manifest_path} names owner {owner} but has no signature "
                f"({path}); get it from the owner (atoll manifest sign --key OWNER_KEY "
                f"{Path(manifest_path).name})"
            ) from None
        return SignatureCheck(None, owner, path)
    except OSError as e:
        raise ManifestSignatureError(
            f"cannot read the manifest signature {path}: {e.strerror or e}"
        ) from None
    if len(raw) > MAX_SIGNATURE_FILE_BYTES:
        raise ManifestSignatureError(
            f"{path}: over {MAX_SIGNATURE_FILE_BYTES} bytes, not a manifest signature"
        )
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ManifestSignatureError(f"{path}: not a manifest signature (not text)") from None
    signer = verify_signature_text(manifest, text, source=str(path))
    return SignatureCheck(signer, owner, path)
