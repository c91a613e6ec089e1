"""An attacker in a real swarm: ``atoll node`` processes on 127.0.0.1, one of them hostile
by attack injection (``ATOLL_ATTACK``), the run's ``[robust]`` table on (trimmed mean,
part checks, which seal every part). Every honest node bans it and logs the ban: the
owners that caught its parts, and the members that checked the sealed proof in an owner's
abort; nobody honest is banned, and the honest nodes finish on one global copy."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROBUST = '\n[robust]\nrule = "trimmed_mean"\nchecks = true\n'


def test_a_member_sending_huge_parts_is_banned_and_the_others_end_on_one_copy(
    local_swarm: Any,
) -> None:
    swarm = local_swarm
    swarm.start_bootstrap()
    run = swarm.write_manifest("run", swarm.manifest() + ROBUST)
    honest = [swarm.start_node(f"n{i}", run, steps=40, wait_peers=3) for i in range(3)]
    hostile = swarm.start_node("bad", run, steps=40, wait_peers=3, env={"ATOLL_ATTACK": "huge"})
    for node in [*honest, hostile]:
        assert node.wait(200) == 0, node.tail()
    bad_id = hostile.info()["peer_id"]
    bans = [re.findall(r"banned peer (\S+) for (\d+) s: (\w+)", n.stderr()) for n in honest]
    # every honest node banned it (caught its parts, or checked the proof in its own
    # abort), nobody else; but a node whose round failed first on a groupmate's abort
    # that quotes the attacker's holds hearsay (nothing it can check), and acts on none
    honest_ids = "|".join(re.escape(n.info()["peer_id"]) for n in honest)
    relayed = re.compile(rf"aborted by (?:{honest_ids}): aborted by {re.escape(bad_id)}: ")
    unbanned = [n for n, found in zip(honest, bans, strict=True) if not found]
    assert len(unbanned) <= 1, [n.tail() for n in honest]
    assert all(relayed.search(n.stderr()) for n in unbanned), [n.tail() for n in unbanned]
    assert {peer for found in bans for peer, _, _ in found} == {bad_id}, bans
    assert sum(n.info()["bans"] for n in honest) >= 1
    # the honest nodes kept training together after the ban, and agree at the end
    assert swarm.agreeing_rounds(honest)
    assert all(n.summary["settled"] for n in honest), [n.summary["settle_detail"] for n in honest]
    assert len({n.summary["global_digest"] for n in honest}) == 1
    assert all(n.summary["rounds_applied"] >= 1 for n in honest)
    assert all(n.summary["last_loss"] < n.summary["first_loss"] for n in honest)
