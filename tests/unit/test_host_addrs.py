"""What a host listens on and what it tells peers (node/net/host.py)."""

from __future__ import annotations

import ipaddress
import socket

import multiaddr
import pytest

from atoll.node.net.host import _advertised, exclusive_listen_addr, expand_wildcard
from atoll.protocol.errors import ConfigError


def test_wildcards_are_advertised_as_interface_addresses_and_others_kept() -> None:
    loop = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")
    wild = multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4002")
    out = _advertised([loop, wild, loop])
    assert out[0] == loop and out.count(loop) == 1
    expanded = [a for a in out if a != loop]
    assert expanded, "the wildcard must turn into at least one address"
    for addr in expanded:
        assert not ipaddress.ip_address(addr.value_for_protocol("ip4")).is_unspecified
        assert addr.value_for_protocol("tcp") == "4002"
    assert expand_wildcard(loop) == [loop]


def test_port_zero_becomes_a_free_port_and_a_taken_port_is_refused() -> None:
    addr = exclusive_listen_addr("/ip4/127.0.0.1/tcp/0")
    port = int(multiaddr.Multiaddr(addr).value_for_protocol("tcp"))
    assert port > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        with pytest.raises(ConfigError, match="cannot listen"):
            exclusive_listen_addr(f"/ip4/127.0.0.1/tcp/{taken}")
    assert exclusive_listen_addr("/dns4/example.invalid/tcp/0") == "/dns4/example.invalid/tcp/0"
