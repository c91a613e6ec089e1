"""Strikes and bans in whole swarms on the in-memory network under a fake clock.

The swarm of :mod:`tests.unit.test_syncer_memory` (its helpers are imported), each node
with a strike ledger (:class:`~atoll.protocol.strikes.Strikes`) wired as the swarm worker
wires it: the syncer strikes the culprits of failed rounds and leaves banned peers out of
matchmaking, the tracker out of the states it follows and of group sizes. A hostile
member is made so by attack injection (:mod:`atoll.node.net.attacks`).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import trio

from atoll.dht.records import EvidenceRecord, PeerRecord, encode_value
from atoll.node.envelopes import EnvelopeSigner, EnvelopeVerifier
from atoll.node.net.attacks import FORGED_VERSION, HostileTransport, parse_attack
from atoll.node.net.memory import MemoryNetwork
from atoll.node.net.publisher import EvidenceExchange
from atoll.protocol import statesync as ss
from atoll.protocol.codecs import make_codec
from atoll.protocol.manifest import RobustSettings
from atoll.protocol.strikes import Strikes
from tests.unit.test_syncer_memory import (
    RUN,
    TIMEOUTS,
    NamedVerifier,
    Node,
    _identity,
    _node,
    _run,
    _swarm,
    _sync_nodes,
)


def _arm(node: Node) -> Strikes:
    """Give ``node`` a strike ledger, wired into its syncer and tracker."""
    strikes = Strikes(clock=trio.current_time)
    node.syncer.strikes = strikes
    node.syncer.peers.banned = strikes.banned
    return strikes


@pytest.mark.parametrize("sealed", [False, True])
def test_a_member_scaling_its_part_by_1e6_is_banned_within_3_rounds_and_rounds_go_on(
    caplog: pytest.LogCaptureFixture, sealed: bool
) -> None:
    """Without seals each honest owner bans the sender of the huge part it caught itself,
    within 3 of the attacker's rounds; with sealed parts (every node with a signer and an
    opener, as in a real swarm) the owner's abort carries the proof and every honest node
    bans it after its first round."""

    async def main() -> None:
        async with MemoryNetwork.open(run_id=RUN) as net, trio.open_nursery() as services:
            robust = RobustSettings(rule="trimmed_mean", checks=True)
            _, nodes = await _swarm(net, services, 5, robust=robust)
            ledgers = [_arm(n) for n in nodes]
            if sealed:
                for n in nodes:
                    n.syncer.signer = EnvelopeSigner(_identity(n.peer))
                    n.syncer.opener = NamedVerifier()
                    assert n.syncer.sealed
            hostile = nodes[4]
            attack = parse_attack("huge")
            assert attack is not None
            hostile.syncer.tamper = attack.tamper
            honest = nodes[:4]
            hostile_rounds = 0
            banned_after: int | None = None
            for k in range(6):
                await _sync_nodes(nodes, 3 + 4 * k, k)
                report = hostile.report
                assert report is not None
                if len(report.done.members) > 1:
                    hostile_rounds += 1
                if banned_after is None and all(s.banned(hostile.peer) for s in ledgers[:4]):
                    banned_after = hostile_rounds
            assert banned_after is not None and banned_after <= (1 if sealed else 3), banned_after
            # the last rounds: the honest nodes apply among themselves, without it
            for n in honest:
                assert n.report is not None
                assert n.report.done.round_status == "applied", n.report.done.reason
                assert hostile.peer not in n.report.done.members
            assert len({n.state() for n in honest}) == 1
            # its huge parts never went into the honest copy
            assert float(np.max(np.abs(honest[0].engine.global_params(0)))) < 100.0
            services.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, logger="atoll.protocol.strikes"):
        _run(main)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("banned peer")]
    assert lines and all(line.startswith("banned peer peer-4 for 60 s: part:") for line in lines)


def _applied_without(honest: list[Node], hostile: Node, version: int) -> None:
    """Every honest node's last sync applied a round without ``hostile``, reaching
    ``version``, and they hold one state."""
    for n in honest:
        assert n.report is not None
        assert n.report.done.round_status == "applied", n.report.done.reason
        assert hostile.peer not in n.report.done.members
        assert n.engine.version(0) == version
    assert len({n.state() for n in honest}) == 1


@pytest.mark.parametrize("attack_spec", ["huge", "nan", "owner"])
def test_a_round_failed_on_a_proven_fault_forms_again_without_its_author(
    caplog: pytest.LogCaptureFixture, attack_spec: str
) -> None:
    """Sealed parts and verified owners: the attacker's first round fails on its part
    (or, as a chunk's owner, on the wrong chunk it returned), the abort's proof bans it at
    every honest node, and each of them seeks the slot again at once: their first sync
    ends applied, among the four, at the slot the attacker spoiled (before, the round was
    lost and the slot met a period later)."""

    async def main() -> None:
        async with MemoryNetwork.open(run_id=RUN) as net, trio.open_nursery() as services:
            robust = RobustSettings(rule="trimmed_mean", checks=True, verify_owners=True)
            _, nodes = await _swarm(net, services, 5, robust=robust)
            ledgers = [_arm(n) for n in nodes]
            for n in nodes:
                n.syncer.signer = EnvelopeSigner(_identity(n.peer))
                n.syncer.opener = NamedVerifier()
            hostile, honest = nodes[4], nodes[:4]
            attack = parse_attack(attack_spec)
            assert attack is not None
            if attack.name == "owner":
                hostile.syncer.tamper_reduced = attack.tamper_reduced(
                    make_codec(hostile.engine.config.codec)
                )
            elif attack.tamper is not None:
                hostile.syncer.tamper = attack.tamper
            else:  # its parts are spoiled as they leave, and sealed again
                hostile.syncer.transport = HostileTransport(
                    hostile.syncer.transport,
                    attack,
                    hostile.engine.config.codec,
                    EnvelopeSigner(_identity(hostile.peer)),
                )
            await _sync_nodes(nodes, 3, 0)
            assert all(s.banned(hostile.peer) for s in ledgers[:4])
            _applied_without(honest, hostile, 1)  # at the slot of the spoiled round
            assert hostile.report is not None
            assert hostile.report.done.round_status != "applied"
            assert float(np.max(np.abs(honest[0].engine.global_params(0)))) < 100.0
            services.cancel_scope.cancel()

    with caplog.at_level(logging.INFO, logger="atoll.node.net.syncer"):
        _run(main)
    again = [r.getMessage() for r in caplog.records if "group again" in r.getMessage()]
    # each honest node once (the hostile owner bans the verifier that caught it, in its
    # own ledger, and seeks the slot too, in vain)
    assert sum("member peer-4's fault" in line for line in again) == 4, again


def test_a_member_of_the_last_round_claiming_more_than_its_periods_is_banned() -> None:
    """Every sync weighs 1000 tokens (one period) and the run's cap is five periods: an
    attacker claiming 4 periods passes the run's cap and the group check (10 x the
    median) in its first round, but in the next round at the version that round made,
    every honest member caps it at 3 periods (it committed that round, so it trained
    about one period since), the proof of its sealed part convicts it, and the honest
    four form the slot's group again without it."""

    async def main() -> None:
        async with MemoryNetwork.open(run_id=RUN) as net, trio.open_nursery() as services:
            robust = RobustSettings(rule="trimmed_mean", checks=True)
            _, nodes = await _swarm(net, services, 5, robust=robust)
            ledgers = [_arm(n) for n in nodes]
            for n in nodes:
                n.syncer.signer = EnvelopeSigner(_identity(n.peer))
                n.syncer.opener = NamedVerifier()
                n.syncer.weight_cap = 5000.0  # five periods of 1000 tokens
            hostile, honest = nodes[4], nodes[:4]
            attack = parse_attack("weight:4")
            assert attack is not None
            hostile.syncer.tamper = attack.tamper
            await _sync_nodes(nodes, 3, 0)
            for n in honest:  # in the run's bounds: applied with it
                assert n.report is not None
                assert n.report.done.round_status == "applied", n.report.done.reason
                assert hostile.peer in n.report.done.members
            assert not any(s.banned(hostile.peer) for s in ledgers[:4])
            await _sync_nodes(nodes, 7, 1)
            assert all(s.banned(hostile.peer) for s in ledgers[:4])
            _applied_without(honest, hostile, 2)
            services.cancel_scope.cancel()

    _run(main)


class EvidenceBoard:
    """The run's evidence records, in memory."""

    def __init__(self) -> None:
        self.records: dict[str, EvidenceRecord] = {}

    async def announce_evidence(self, record: EvidenceRecord, /) -> None:
        await trio.lowlevel.checkpoint()
        self.records[record.peer_id] = record

    async def find_evidence(self) -> list[EvidenceRecord]:
        await trio.lowlevel.checkpoint()
        return list(self.records.values())


def test_a_forger_is_banned_and_its_evidence_convinces_a_node_that_never_saw_it() -> None:
    """A peer whose signed record claims version 10^6 is banned by the nodes that read it
    once the claim's grace has passed (the time an honest commit's certificate takes to
    be found); one of them publishes the record as evidence, and a node whose directory
    never showed the forger bans it on that evidence alone, while a claim a node can
    check to be certified convicts nobody."""

    async def main() -> None:
        async with MemoryNetwork.open(run_id=RUN) as net, trio.open_nursery() as services:
            directory, nodes = await _swarm(net, services, 3)
            forger = _identity("forger").peer_id  # a real id: its record is sealed
            net.transport(forger)
            now = net.wall()
            forged = PeerRecord(
                forger,
                RUN,
                (),
                "atoll/test",
                0.0,
                (FORGED_VERSION,),
                ("f" * ss.DIGEST_LEN,),
                True,
                now,
                now + 120.0,
            )
            sealed = encode_value(forged, EnvelopeSigner(_identity("forger")))
            directory.forged.append((forger, FORGED_VERSION, "f" * ss.DIGEST_LEN))
            ledgers = [_arm(n) for n in nodes]
            board = EvidenceBoard()

            async def sealed_of(peer: str) -> bytes | None:
                await trio.lowlevel.checkpoint()
                return sealed if peer == forger else None

            def exchange(node: Node, strikes: Strikes) -> EvidenceExchange:
                beliefs = node.syncer.peers.beliefs
                assert beliefs is not None
                return EvidenceExchange(
                    board,
                    peer_id=node.peer,
                    run_id=RUN,
                    wall=net.wall,
                    verifier=EnvelopeVerifier(),
                    strikes=strikes,
                    beliefs=beliefs,
                    held=lambda p: (node.engine.version(p), node.engine.digest(p)),
                    sealed_of=sealed_of,
                    attestations=net.board,
                )

            accuser = exchange(nodes[0], ledgers[0])
            ledgers[0].on_ban = accuser.on_ban
            # the node's hook: a claim past everything believed is a forgery
            for n, strikes in zip(nodes, ledgers, strict=True):
                beliefs = n.syncer.peers.beliefs
                assert beliefs is not None

                def on_uncertified(
                    peer: str, p: int, v: int, n: Node = n, strikes: Strikes = strikes
                ) -> None:
                    n.reported.append((peer, p, v))
                    strikes.strike(peer, "forged" if v > n.engine.version(p) + 1 else "uncertified")

                beliefs.on_uncertified = on_uncertified
            for k in range(2):
                await _sync_nodes(nodes, 3 + 4 * k, k)
                assert all(n.report.done.round_status == "applied" for n in nodes)  # type: ignore[union-attr]
            assert not any(strikes.banned(forger) for strikes in ledgers)  # within its grace
            await trio.sleep(TIMEOUTS.matchmaking_s + TIMEOUTS.round_s)
            for n in nodes:
                await n.syncer.peers.refresh()
                n.syncer.peers.holdings(0, n.state())
            for strikes in ledgers:
                assert strikes.banned(forger)
            await accuser.publish_due()
            assert accuser.published == 1 and list(board.records) == [nodes[0].peer]
            # a node that never saw the forger's record: its directory shows none
            late = await _node(
                net,
                type(directory)(net),
                "peer-late",
                services,
                initial=np.zeros(nodes[0].engine.global_params(0).size, np.float32),
            )
            late_strikes = _arm(late)
            reader = exchange(late, late_strikes)
            assert not late_strikes.banned(forger)
            assert await reader.read() == 1
            assert late_strikes.banned(forger)
            ban = late_strikes.ban_of(forger)
            assert ban is not None and ban.reason.startswith("evidence:")
            assert nodes[0].peer in ban.reason
            # a signed record of a state within reach convicts nobody
            victim = _identity("victim").peer_id
            held = dataclasses.replace(
                forged, peer_id=victim, versions=(1,), digests=(nodes[0].state()[1],)
            )
            claim = encode_value(held, EnvelopeSigner(_identity("victim")))
            assert not await reader.judge(nodes[0].peer, claim)
            # nor does a forged record sealed by someone else than the peer it names
            framed = dataclasses.replace(forged, peer_id=victim)
            sealed_by_other = encode_value(framed, EnvelopeSigner(_identity("forger")))
            assert not await reader.judge(nodes[0].peer, sealed_by_other)
            assert late_strikes.banned_peers() == (forger,)
            services.cancel_scope.cancel()

    _run(main)
