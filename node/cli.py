"""The ``atoll`` command line.

Subcommands (more come with the swarm):

- ``atoll simulate``: M replicas in one process, no network; progress and a final table.
- ``atoll node``: one peer of a swarm (joins through a bootstrap, trains a run's manifest).
- ``atoll demo``: a bootstrap and 4 nodes on 127.0.0.1 train together, with a live table
  (``--simulated``: the in-process comparison with data-parallel).
- ``atoll bootstrap``: a light DHT-only peer (no torch, no GPU) for the swarm to meet at.
- ``atoll status``: the peers, runs and versions the DHT peers at ``--join`` know of.
- ``atoll keygen PATH``: a new Ed25519 key file (a node's identity, or an organisation's
  key); prints its peer id and public key.
- ``atoll org issue``: a member certificate for a peer, signed by an organisation key.
- ``atoll manifest sign --key OWNER_KEY run.toml``: the run owner's signature of a manifest
  (``run.toml.sig``); ``atoll manifest verify run.toml`` checks it as a joiner does.
- ``atoll version``.

Errors atoll raises on purpose are printed as one line (``atoll: error: ...``; a join
that failed through several addresses, one such line per address), never as a traceback;
Ctrl+C stops with exit status 130, except ``atoll bootstrap``, a service for which SIGINT
and SIGTERM are the normal way to stop: exit status 0.

Building the parser imports no torch (the config dataclasses live in
:mod:`atoll.node.settings`); each subcommand imports what it runs when it runs, so
``atoll bootstrap`` and ``atoll version`` never load torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any, TextIO

from atoll.node.config import add_arguments, build_config, field_help, load_toml
from atoll.node.demo import DemoConfig
from atoll.node.logconf import debug_from_env
from atoll.node.settings import BootstrapConfig, NodeConfig, SimConfig
from atoll.protocol.errors import AtollError, ConfigError
from atoll.protocol.manifest import OuterLoop

__all__ = ["format_table", "main"]

log = logging.getLogger("atoll")


class _ProgressPrinter:
    """One status line per report; rewritten in place on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def __call__(self, p: Any) -> None:
        ev = f"  eval {p.eval_loss:.4f}" if p.eval_loss is not None else ""
        line = (
            f"[{p.algo:>9}] step {p.step:>5}/{p.steps}  loss {p.loss:.4f}  "
            f"{p.tokens_per_s / 1e3:7.1f} ktok/s  sent {p.bytes_per_replica / 1e6:9.3f} MB{ev}"
        )
        if self.tty and p.step < p.steps and p.eval_loss is None:
            self.stream.write("\r" + line)
        else:
            self.stream.write(("\r" if self.tty else "") + line + "\n")
        self.stream.flush()


def format_table(results: Sequence[Any]) -> str:
    """The final comparison table; ratios are against the ddp row when there is one."""
    base = next((r for r in results if r.algo == "ddp"), None)
    head = (
        f"{'run':<22}{'eval loss':>10}{'vs ddp':>9}{'tokens':>12}"
        f"{'MB/replica':>13}{'bytes ÷':>10}{'wall s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        label = r.config.get("label") or r.algo
        rel = f"{(r.eval_loss / base.eval_loss - 1) * 100:+.1f}%" if base and r is not base else ""
        ratio = (
            f"{r.bytes_ratio:.0f}x"
            if r.algo != "ddp" and r.bytes_per_replica
            else ("1x" if r.algo == "ddp" else "-")
        )
        lines.append(
            f"{label:<22}{r.eval_loss:>10.4f}{rel:>9}{r.tokens:>12,}"
            f"{r.bytes_per_replica / 1e6:>13.3f}{ratio:>10}{r.wall_s:>9.1f}"
        )
    return "\n".join(lines)


def _setup_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    debug_from_env()


def _cmd_simulate(args: argparse.Namespace) -> int:
    from atoll.node.simulate import simulate

    toml = load_toml(args.config, "simulate") if args.config else None
    cfg = build_config(SimConfig, args, toml)
    printer = _ProgressPrinter(sys.stderr)
    result = simulate(cfg, progress=printer)
    print(format_table([result]))
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.simulated:
        return _simulated_demo(args)
    from atoll.node.demo import run_demo

    cfg = DemoConfig(
        nodes=args.replicas,
        steps=args.steps,
        preset=args.preset,
        H=args.H,
        tau=args.tau,
        workdir=args.workdir,
    )
    summary = run_demo(cfg)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if not summary["ok"]:
        raise AtollError("some nodes did not finish; their logs are in the demo's folder")
    return 0


def _simulated_demo(args: argparse.Namespace) -> int:
    from atoll.node.data import load_corpus
    from atoll.node.simulate import simulate

    print(
        f"atoll demo --simulated: {args.replicas} simulated peers train the '{args.preset}' "
        f"model for {args.steps} steps, data-parallel and Streaming DiLoCo (4-bit, "
        f"H={args.H}), in one process, no network.",
        file=sys.stderr,
    )
    corpus = load_corpus("stdlib")
    printer = _ProgressPrinter(sys.stderr)
    base = SimConfig(
        replicas=args.replicas,
        steps=args.steps,
        preset=args.preset,
        H=args.H,
        warmup=min(50, args.steps // 10),
        log_every=max(1, args.steps // 20),
    )
    results = []
    for algo, lr in (("ddp", 2e-3), ("streaming", 3e-3)):
        results.append(simulate(base.with_(algo=algo, lr=lr), corpus=corpus, progress=printer))
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in results], indent=2))
    return 0


def _join_address_lists(
    args: argparse.Namespace, toml: dict[str, Any] | None, names: Sequence[str]
) -> None:
    """Address settings given several times (a repeated flag, a TOML list) become the one
    comma-separated string the config dataclasses hold."""
    for name in names:
        if toml is not None and isinstance(toml.get(name), list):
            toml[name] = ",".join(str(a) for a in toml[name])
        if getattr(args, name) is not None:
            setattr(args, name, ",".join(getattr(args, name)))


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from atoll.node.bootstrap import run  # trio and libp2p, never torch

    toml = load_toml(args.config, "bootstrap") if args.config else None
    _join_address_lists(args, toml, ("listen",))
    cfg = build_config(BootstrapConfig, args, toml)

    def ready(addrs: Sequence[str]) -> None:
        for addr in addrs:  # the lines an operator (or a script) hands to peers
            print(f"bootstrap: {addr}", flush=True)

    signame = run(cfg, on_ready=ready)
    print(f"atoll bootstrap: stopped ({signame})", file=sys.stderr, flush=True)
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from atoll.security.identity import load_or_create

    path = Path(args.path).expanduser()
    if path.exists() or path.is_symlink():
        raise ConfigError(f"{path} exists; atoll keygen never replaces a key")
    identity = load_or_create(path)
    print(f"key file:   {path}")
    print(f"peer id:    {identity.peer_id}")
    print(f"public key: {identity.public_key.hex()}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from atoll.node.export import export_model
    from atoll.protocol.manifest import RunManifest
    from atoll.security.identity import load_or_create

    folder = args.checkpoint
    if not folder:
        key = Path(args.identity).expanduser()
        if not key.is_file():
            raise ConfigError(
                f"no identity {key}: name the node's --identity or its --checkpoint folder"
            )
        run_id = RunManifest.load(Path(args.run).expanduser()).run_id()
        peer_id = load_or_create(key).peer_id
        folder = str(NodeConfig(run=args.run, identity=str(key)).checkpoint_folder(run_id, peer_id))
    print(export_model(args.run, folder, args.out).describe())
    return 0


def _cmd_org_issue(args: argparse.Namespace) -> int:
    from atoll.security.identity import load_or_create
    from atoll.security.membership import issue, read_certificate

    key = Path(args.org_key).expanduser()
    if not key.is_file():
        raise ConfigError(f"organisation key {key} not found (make one with: atoll keygen PATH)")
    if not args.days > 0:
        raise ConfigError(f"--days must be > 0, not {args.days}")
    org = load_or_create(key)
    now = int(time.time())
    data = issue(
        org, args.peer, role=args.role, issued_at=now, expires_at=now + int(args.days * 86400)
    )
    out = Path(args.out).expanduser()
    try:
        out.write_bytes(data)
    except OSError as e:
        raise ConfigError(f"cannot write the certificate {out}: {e.strerror or e}") from None
    cert = read_certificate(data)
    expires = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(cert.expires_at))
    print(f"certificate: {out} ({len(data)} bytes)")
    print(f"peer id:     {cert.peer_id} (role {cert.role})")
    print(f"expires:     {expires}")
    print(f"cert id:     {cert.cert_id}  (to revoke it: [membership] revoked)")
    print(f"org key:     {org.public_key.hex()}  ([membership] org_key)")
    return 0


def _cmd_manifest_sign(args: argparse.Namespace) -> int:
    from atoll.protocol.manifest import RunManifest
    from atoll.security.identity import load_or_create
    from atoll.security.manifest_sig import write_signature

    key = Path(args.key).expanduser()
    if not key.is_file():
        raise ConfigError(f"owner key {key} not found (make one with: atoll keygen PATH)")
    path = Path(args.manifest).expanduser()
    manifest = RunManifest.load(path)
    owner = load_or_create(key)
    out = write_signature(owner, manifest, path, args.out)
    print(f"signature: {out}")
    print(f"run:       {manifest.name!r}, run id {manifest.run_id()}")
    print(f"signed by: {owner.peer_id}")
    if not manifest.owner:
        print(
            f"note: the manifest names no owner, so joiners do not require this signature; "
            f'add owner = "{owner.peer_id}" to it (a new run id), then sign again'
        )
    return 0


def _cmd_manifest_verify(args: argparse.Namespace) -> int:
    from atoll.protocol.manifest import RunManifest
    from atoll.security.manifest_sig import check_manifest_signature

    path = Path(args.manifest).expanduser()
    manifest = RunManifest.load(path)
    check = check_manifest_signature(manifest, path, args.sig)
    print(f"{path}: run {manifest.name!r} ({manifest.run_id()[:12]}): {check.describe()}")
    return 0


def _cmd_node(args: argparse.Namespace) -> int:
    from atoll.node.daemon import ProgressPrinter, run_node
    from atoll.node.settings import check_own_membership, read_certificate_file
    from atoll.protocol.manifest import RunManifest
    from atoll.security.identity import load_or_create
    from atoll.security.manifest_sig import check_manifest_signature

    toml = load_toml(args.config, "node") if args.config else None
    _join_address_lists(args, toml, ("join", "listen"))
    cfg = build_config(NodeConfig, args, toml)
    manifest_path = Path(cfg.run).expanduser()
    manifest = RunManifest.load(manifest_path)
    # a manifest naming its owner is trusted only with the owner's signature next to it
    signature = check_manifest_signature(manifest, manifest_path)
    print(f"atoll node: {signature.describe()}", file=sys.stderr, flush=True)
    # a node its run's membership refuses is stopped here, with the reason, rather than
    # refused by every peer it dials
    identity = load_or_create(Path(cfg.identity).expanduser())
    certificate = read_certificate_file(cfg.cert) if cfg.cert else None
    check_own_membership(manifest, identity.peer_id, certificate)
    printer = ProgressPrinter(cfg.progress)

    def started(info: dict[str, Any]) -> None:
        print(
            f"atoll node: peer {info.get('peer_id')} of run {str(info.get('run_id'))[:12]} "
            f"from step {info.get('start_step', 0)}; listening on "
            + ", ".join(info.get("addrs", [])),
            file=sys.stderr,
            flush=True,
        )

    summary = run_node(cfg, progress=printer, on_start=started)
    text = (
        f"atoll node: {summary.steps} steps ({summary.stopped_by}), loss "
        f"{summary.first_loss:.4f} -> {summary.last_loss:.4f}"
        + (f", eval {summary.eval_loss:.4f}" if summary.eval_loss is not None else "")
        + f"; rounds applied {summary.rounds_applied}, failed {summary.rounds_failed}, "
        f"alone {summary.rounds_alone}, rebases {summary.rebases}; "
        f"up {summary.bytes_up / 1e6:.2f} MB (data-parallel: {summary.ddp_bytes / 1e6:.1f} MB); "
        f"compute {100 * summary.utilisation:.1f}% of wall"
    )
    if cfg.progress == "jsonl":
        print(json.dumps({"summary": summary.as_dict()}), flush=True)
    print(text, file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(summary.as_dict(), indent=2))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from atoll.node.doctor import run_doctor

    checks = run_doctor(
        listen=args.listen,
        joins=args.join,
        checkpoint_dir=Path(args.checkpoint_dir),
        timeout_s=args.timeout_s,
    )
    for check in checks:
        print(check.line(), flush=True)
    return 1 if any(c.verdict == "fail" for c in checks) else 0


def _cmd_status(args: argparse.Namespace) -> int:
    from atoll.node.swarmstatus import format_view, query
    from atoll.protocol.manifest import RunManifest

    run_id = run_name = None
    if args.run:
        manifest = RunManifest.load(Path(args.run).expanduser())
        run_id, run_name = manifest.run_id(), manifest.name
    view = query(args.join, timeout_s=args.timeout_s)
    if args.json:
        records = [
            {
                "run_id": r.run_id,
                "peer_id": r.peer_id,
                "addrs": list(r.addrs),
                "agent": r.agent,
                "tokens_per_s": r.tokens_per_s,
                "versions": list(r.versions),
                "digests": list(r.digests),
                "issued_at": r.issued_at,
                "expires_at": r.expires_at,
            }
            for r in view.records
            if run_id is None or r.run_id == run_id
        ]
        Path(args.json).write_text(json.dumps({"peers": records, "asked": view.answered}))
    print(format_view(view, run_id=run_id, run_name=run_name or ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll", description="Peer-to-peer Streaming DiLoCo training."
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="train M replicas in one process, no network")
    add_arguments(sim, SimConfig, help_from=OuterLoop)
    sim.add_argument("--config", help="TOML file (a [simulate] table or top-level keys)")
    sim.add_argument("--json", help="write the result to this file")
    sim.set_defaults(func=_cmd_simulate)

    demo = sub.add_parser(
        "demo",
        help="a bootstrap and 4 nodes on 127.0.0.1 train together; a live table",
        description=(
            "Start a bootstrap peer and N node processes on this machine, train the tiny "
            "model for a few minutes, print a live table and a summary (loss, bytes per "
            "peer, bytes data-parallel would have needed)."
        ),
    )
    demo.add_argument("--replicas", "--nodes", type=int, default=4, help="nodes (default 4)")
    demo.add_argument("--steps", type=int, default=DemoConfig.steps)
    for name in ("H", "tau"):  # the run's outer loop: OuterLoop's help, the demo's defaults
        demo.add_argument(
            f"--{name}",
            type=int,
            default=getattr(DemoConfig, name),
            help=f"{field_help(OuterLoop)[name]} (default: %(default)s)",
        )
    demo.add_argument("--preset", default=DemoConfig.preset)
    demo.add_argument("--workdir", help="keep the nodes' files and logs in this folder")
    demo.add_argument(
        "--simulated",
        action="store_true",
        help="instead: simulated peers in one process, data-parallel next to streaming",
    )
    demo.add_argument("--json", help="write the summary to this file")
    demo.set_defaults(func=_cmd_demo)

    boot = sub.add_parser(
        "bootstrap",
        help="run a light DHT-only peer for the swarm to meet at (no torch, no GPU)",
        description=(
            "Serve atoll's DHT for the peers of every run until SIGINT or SIGTERM. Prints "
            "'bootstrap: <multiaddr>' for each address once it serves; hand these to peers."
        ),
    )
    add_arguments(boot, BootstrapConfig, skip=("listen",))
    boot.add_argument(
        "--listen",
        action="append",
        metavar="MULTIADDR",
        help=(
            "multiaddr to listen on; repeat for several "
            f"(default: {BootstrapConfig.listen}; use a fixed port, peers are told it)"
        ),
    )
    boot.add_argument("--config", help="TOML file (a [bootstrap] table or top-level keys)")
    boot.set_defaults(func=_cmd_bootstrap)

    node = sub.add_parser(
        "node",
        help="train as one peer of a swarm",
        description=(
            "Join a swarm through --join addresses and train the run a manifest defines. "
            "Ctrl+C stops cleanly after the current step."
        ),
    )
    add_arguments(node, NodeConfig, skip=("join", "listen", "fault"))
    node.add_argument(
        "--join",
        action="append",
        metavar="MULTIADDR",
        help="bootstrap or peer address (/ip4/.../tcp/.../p2p/12D3KooW...); repeat for several",
    )
    node.add_argument(
        "--listen",
        action="append",
        metavar="MULTIADDR",
        help=f"multiaddr to listen on; repeat for several (default: {NodeConfig.listen})",
    )
    node.add_argument("--config", help="TOML file (a [node] table or top-level keys)")
    node.add_argument("--json", help="write the summary to this file")
    node.set_defaults(func=_cmd_node)

    status = sub.add_parser(
        "status",
        help="the swarm as the DHT sees it: peers, runs, versions",
        description=(
            "Ask peers (bootstrap peers or nodes) for the peer records they hold and print "
            "them per run. Every record is checked here (signature, expiry)."
        ),
    )
    status.add_argument(
        "--join", action="append", required=True, metavar="MULTIADDR", help="peer to ask"
    )
    status.add_argument("--run", help="only this run's peers (its manifest)")
    status.add_argument("--timeout-s", type=float, default=10.0, help="per peer (default 10)")
    status.add_argument("--json", help="also write the records to this file")
    status.set_defaults(func=_cmd_status)

    doctor = sub.add_parser(
        "doctor",
        help="check this machine before joining a swarm: torch, disk, port, reachability",
        description=(
            "One line per check, each with a verdict (ok, warn, fail, skip) and what to do: "
            "torch and its device, free disk for checkpoints, the listen port, whether the "
            "--join peers can dial this node back (behind a NAT or firewall they cannot), "
            "and the clock's skew against theirs. Exit status 1 when a check failed."
        ),
    )
    doctor.add_argument(
        "--join", action="append", default=[], metavar="MULTIADDR", help="peer to ask"
    )
    doctor.add_argument(
        "--listen",
        default="/ip4/0.0.0.0/tcp/4001",
        help="the address the node will listen on (default /ip4/0.0.0.0/tcp/4001)",
    )
    doctor.add_argument(
        "--checkpoint-dir",
        default="~/.atoll/checkpoints",
        help="where checkpoints will go (default ~/.atoll/checkpoints)",
    )
    doctor.add_argument("--timeout-s", type=float, default=10.0, help="per peer (default 10)")
    doctor.set_defaults(func=_cmd_doctor)

    keygen = sub.add_parser(
        "keygen",
        help="write a new Ed25519 key file; print its peer id and public key",
        description=(
            "Write a new Ed25519 key file (mode 0600), the format of a node's --identity; "
            "use it as a node identity or as an organisation key. Prints the peer id and "
            "the public key (hex, for a manifest's [membership] org_key). Never replaces "
            "an existing file."
        ),
    )
    keygen.add_argument("path", metavar="PATH", help="the key file to create")
    keygen.set_defaults(func=_cmd_keygen)

    org = sub.add_parser("org", help="an organisation's private swarm: member certificates")
    org_sub = org.add_subparsers(dest="org_command", required=True)
    org_issue = org_sub.add_parser(
        "issue",
        help="sign a member certificate for a peer",
        description=(
            "Sign a member certificate for --peer with the organisation key; a node shows "
            "it with 'atoll node --cert CERT' in a run whose manifest names the key."
        ),
    )
    org_issue.add_argument("--org-key", required=True, metavar="PATH", help="organisation key file")
    org_issue.add_argument("--peer", required=True, metavar="PEER_ID", help="the member's peer id")
    org_issue.add_argument("--role", default="member", help="the member's role (default: member)")
    org_issue.add_argument(
        "--days", type=float, default=365.0, help="days the certificate counts (default: 365)"
    )
    org_issue.add_argument("--out", required=True, metavar="CERT", help="file to write")
    org_issue.set_defaults(func=_cmd_org_issue)

    man = sub.add_parser("manifest", help="a run manifest's owner signature")
    man_sub = man.add_subparsers(dest="manifest_command", required=True)
    man_sign = man_sub.add_parser(
        "sign",
        help="sign a run manifest with the run owner's key",
        description=(
            "Sign the manifest's run id with the owner's key and write MANIFEST.sig next to "
            "it (replacing an older one). A node refuses a manifest that names an owner "
            "(owner = PEER_ID) without a valid signature by that owner. Hand the .sig file "
            "out with the manifest."
        ),
    )
    man_sign.add_argument("--key", required=True, metavar="OWNER_KEY", help="owner key file")
    man_sign.add_argument("--out", metavar="PATH", help="write here (default: MANIFEST.sig)")
    man_sign.add_argument("manifest", metavar="MANIFEST", help="the run manifest (TOML)")
    man_sign.set_defaults(func=_cmd_manifest_sign)
    man_verify = man_sub.add_parser(
        "verify",
        help="check a run manifest's signature as a joining node does",
    )
    man_verify.add_argument("--sig", metavar="PATH", help="the signature (default: MANIFEST.sig)")
    man_verify.add_argument("manifest", metavar="MANIFEST", help="the run manifest (TOML)")
    man_verify.set_defaults(func=_cmd_manifest_verify)

    export = sub.add_parser(
        "export",
        help="write the swarm's global model from a node's checkpoint (safetensors + config)",
        description=(
            "Write the global model (every fragment's global copy) of a node's newest "
            "checkpoint into OUT: model.safetensors and config.json, and for an hf: model "
            "a Hugging Face folder OUT/hf. The checkpoint folder is the node's (found from "
            "--identity, as atoll node finds it) unless --checkpoint names one."
        ),
    )
    export.add_argument("--run", required=True, help="the run's manifest (TOML)")
    export.add_argument("--out", required=True, help="the folder to write (new or empty)")
    export.add_argument(
        "--identity",
        default=NodeConfig.identity,
        help=f"the node's identity file (default: {NodeConfig.identity})",
    )
    export.add_argument("--checkpoint", help="a node's checkpoint folder, or one ckpt-NNNNNN")
    export.set_defaults(func=_cmd_export)

    ver = sub.add_parser("version", help="print the version")
    ver.set_defaults(func=lambda _a: print(version("atoll")) or 0)
    return parser


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: a node that stopped has saved its
    checkpoint, stopped its network process, released its identity and printed its
    summary; unloading torch and the rest would only add seconds (more on a busy
    machine) to the exit that Ctrl+C waits for."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    t0 = time.monotonic()
    try:
        code: int = args.func(args)
        if argv is None and args.func is _cmd_node:
            _exit_now(code)
        return code
    except AtollError as e:
        # one line per reason (a failed join names each address on a line of its own)
        for line in str(e).splitlines() or [""]:
            print(f"atoll: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\natoll: interrupted after {time.monotonic() - t0:.0f} s", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
