"""A private swarm on 127.0.0.1: members train, a non-member and a revoked member are refused.

Two levels: atoll hosts in one trio loop (the Hello exchange in both directions, with the
refusal each side sees), and real ``atoll keygen``, ``atoll org issue``, ``atoll
bootstrap --run`` and ``atoll node --cert`` processes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from atoll.node.net.host import HostConfig, WrongRun, open_host
from atoll.protocol.allreduce import Abort
from atoll.security.identity import generate
from atoll.security.membership import Membership, NotAMember, issue

CLI = [sys.executable, "-m", "atoll.node.cli"]
RUN = "ab" * 32
CONFIG = HostConfig(dial_timeout_s=20.0, hello_timeout_s=20.0, send_timeout_s=30.0)

pytestmark = [pytest.mark.integration]


def _cert(org: Any, peer: str) -> bytes:
    now = int(time.time())
    return issue(org, peer, issued_at=now - 60, expires_at=now + 3600)


@pytest.mark.timeout(120)
def test_hello_admits_members_and_refuses_others_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    org, a, b, stranger, revoked = (generate() for _ in range(5))
    policy = Membership(private=True, org_key=org.public_key, revoked=[revoked.peer_id])
    caplog.set_level(logging.WARNING, logger="atoll.node.net.host")

    async def body() -> None:
        async with (
            open_host(a, RUN, CONFIG, membership=policy, certificate=_cert(org, a.peer_id)) as ha,
            open_host(b, RUN, CONFIG, membership=policy, certificate=_cert(org, b.peer_id)) as hb,
        ):
            addr = ha.addrs[0]
            # members: admitted both ways, messages flow
            assert await hb.connect(addr) == a.peer_id
            msg = Abort(RUN, 0, 1, b.peer_id, "hi")
            await hb.send(a.peer_id, msg)
            assert await ha.receive(timeout_s=20) == (b.peer_id, msg)
            assert ha.admitted(b.peer_id) and hb.admitted(a.peer_id)

            # a node of the run without a certificate: refused, and told why
            async with open_host(stranger, RUN, CONFIG, membership=policy) as hs:
                with pytest.raises(NotAMember, match="does not count this node as a member"):
                    await hs.connect(addr)
                # a member dialing a non-member refuses its answer
                with pytest.raises(NotAMember, match="showed no member certificate"):
                    await ha.connect(hs.addrs[0])
            assert not ha.admitted(stranger.peer_id)
            # a peer that ignores membership altogether sees the refusal of another run
            async with open_host(stranger, RUN, CONFIG) as hs:
                with pytest.raises(WrongRun):
                    await hs.connect(addr)
            # a revoked member, its certificate still valid
            cert = _cert(org, revoked.peer_id)
            async with open_host(revoked, RUN, CONFIG, membership=policy, certificate=cert) as hr:
                with pytest.raises(NotAMember):
                    await hr.connect(addr)

    trio.run(body)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused peer")]
    assert any(
        stranger.peer_id in line and "showed no member certificate" in line for line in lines
    ), lines
    assert any(
        revoked.peer_id in line and "the run manifest revokes this peer" in line for line in lines
    ), lines
    assert all("\n" not in line for line in lines)


# -- real processes -------------------------------------------------------------------------
def _atoll(*args: str) -> str:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _keygen(path: Path) -> tuple[str, str]:
    out = _atoll("keygen", str(path))
    fields = dict(line.split(":", 1) for line in out.splitlines())
    return fields["peer id"].strip(), fields["public key"].strip()


@pytest.mark.timeout(420)
def test_members_train_while_a_stranger_and_a_revoked_member_are_refused(
    local_swarm: Any,
) -> None:
    swarm = local_swarm
    tmp: Path = swarm.tmp
    _, org_key = _keygen(tmp / "org.key")
    peers = {name: _keygen(tmp / f"{name}.key")[0] for name in ("boot", "n0", "n1", "revoked")}
    stranger_id = _keygen(tmp / "stranger.key")[0]
    for name, peer in peers.items():
        role = "bootstrap" if name == "boot" else "member"
        _atoll(
            "org", "issue", "--org-key", str(tmp / "org.key"), "--peer", peer,
            "--role", role, "--days", "1", "--out", str(tmp / f"{name}.cert"),
        )  # fmt: skip
    text = swarm.manifest(group={"min_quorum": 2})
    text += (
        f'\n[membership]\nmode = "private"\norg_key = "{org_key}"\n'
        f'revoked = ["{peers["revoked"]}"]\n'
    )
    run = swarm.write_manifest("private", text)

    # the private bootstrap: members only
    addr_file = tmp / "bootstrap.addr"
    boot_err = tmp / "bootstrap.err"
    swarm.boot = subprocess.Popen(
        [
            *CLI,
            "-v",
            "bootstrap",
            "--identity",
            str(tmp / "boot.key"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--addr-file",
            str(addr_file),
            "--run",
            str(run),
            "--cert",
            str(tmp / "boot.cert"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=boot_err.open("w"),
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )

    def started() -> str:
        assert swarm.boot.poll() is None, boot_err.read_text()
        return addr_file.read_text().strip() if addr_file.exists() else ""

    swarm.addr = swarm.wait_until(started, 120, "the private bootstrap's address").split()[0]

    members = [
        swarm.start_node(n, run, steps=30, wait_peers=1, extra=("--cert", str(tmp / f"{n}.cert")))
        for n in ("n0", "n1")
    ]
    # a node without a certificate, and a revoked member: each stopped with one clear line
    stranger = swarm.start_node("stranger", run, steps=30)
    revoked = swarm.start_node(
        "revoked", run, steps=30, extra=("--cert", str(tmp / "revoked.cert"))
    )
    assert stranger.wait(120) == 2
    assert (
        f"atoll: error: this node (peer {stranger_id}) is not a member of run" in stranger.stderr()
    )
    assert "showed no member certificate" in stranger.stderr()
    assert revoked.wait(120) == 2
    assert "the run manifest revokes this peer" in revoked.stderr()

    for node in members:
        assert node.wait(300) == 0, node.tail()
        s = node.summary
        assert s is not None and s["rounds_applied"] >= 1, node.tail()
        assert s["info"]["peers_seen"] == 1, node.tail()
    log = boot_err.read_text()
    assert "refused" not in log, log  # members were never refused
