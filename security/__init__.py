"""atoll.security: who a peer is and whether what it sent can be trusted.

Map of the modules:

- ``identity``  a node's persistent Ed25519 key file, its libp2p peer id, and the lock
                that keeps two running nodes from sharing one identity
- ``signing``   signed envelopes: a payload bound to a domain and to its signer's key
- ``membership`` who may take part in a run: public, an allowlist, or member certificates
                signed by an organisation key; revocation
- ``manifest_sig`` the run owner's signature over a manifest's run id, checked by joiners

Contribution checks, robust aggregation, certified states and strikes work on data, not
on keys, and live in :mod:`atoll.protocol` (``checks``, ``robust``, ``certificate``,
``strikes``); docs/THREAT_MODEL.md says what each defends against.

It imports only :mod:`atoll.protocol` (never libp2p: the node layer turns an
:class:`Identity` into a libp2p key pair). The errors it adds to the tree of
:mod:`atoll.protocol.errors`::

    ConfigError
    └── IdentityError        unusable identity file (unsafe mode, malformed, unreadable)
        └── IdentityInUse    another running node holds the identity's lock
    RejectedInput
    ├── BadSignature         a signed envelope that must not be trusted
    └── NotAMember           a peer the run's membership does not admit
"""

from atoll.security.identity import (
    Identity,
    IdentityError,
    IdentityInUse,
    IdentityLock,
    generate,
    load_or_create,
    peer_id_from_public_key,
    public_key_from_peer_id,
)
from atoll.security.membership import (
    Certificate,
    Membership,
    NotAMember,
    issue,
    read_certificate,
)
from atoll.security.signing import (
    BadSignature,
    SignedEnvelope,
    open_envelope,
    seal,
    signer_peer_id,
)

__all__ = [
    "BadSignature",
    "Certificate",
    "Identity",
    "IdentityError",
    "IdentityInUse",
    "IdentityLock",
    "Membership",
    "NotAMember",
    "SignedEnvelope",
    "generate",
    "issue",
    "load_or_create",
    "open_envelope",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "read_certificate",
    "seal",
    "signer_peer_id",
]
