"""atoll.node: the daemon, the composition root (nothing imports it).

Map of the modules:

- ``cli``       the ``atoll`` command line (``simulate``, ``demo``, ``bootstrap``, ``version``)
- ``config``    frozen dataclasses mapped to CLI flags, TOML and ``ATOLL_*`` variables
- ``settings``  the config dataclasses themselves (``SimConfig``, ``InnerConfig``,
                ``BootstrapConfig``), torch-free so the CLI parser loads no torch
- ``model``     the built-in decoder-only transformer and its presets
- ``data``      the no-download corpus (the stdlib's source) and deterministic batches
- ``train``     one replica: inner AdamW, warmup + cosine, fragment views, evaluation
- ``simulate``  M replicas in one process driving the protocol engine, with byte counts
- ``simattack`` the simulator's rounds through the real all-reduce machines: hostile
                and late replicas, checks, strikes and bans
- ``envelopes`` the DHT's record seal (``RecordSigner``/``RecordVerifier``) over
                atoll.security's Ed25519 envelopes
- ``bootstrap`` ``atoll bootstrap``: a run-agnostic DHT server on a bare host, no torch
"""
