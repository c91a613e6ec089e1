"""The demo's configuration refuses what it cannot run, before anything starts."""

from __future__ import annotations

import pytest

from atoll.node.demo import DemoConfig
from atoll.protocol.errors import ConfigError


def test_a_slowdown_names_a_node_of_the_demo_and_a_factor_of_at_least_one() -> None:
    assert DemoConfig(nodes=3, slowdown={2: 6.0}).slowdown == {2: 6.0}
    for bad in ({3: 2.0}, {-1: 2.0}, {0: 0.5}, {0: float("nan")}):
        with pytest.raises(ConfigError, match="slowdown"):
            DemoConfig(nodes=3, slowdown=bad)


def test_the_demo_needs_two_nodes_and_a_period_of_steps() -> None:
    with pytest.raises(ConfigError, match="2 nodes"):
        DemoConfig(nodes=1)
    with pytest.raises(ConfigError, match="at least H"):
        DemoConfig(steps=10, H=50)
