"""libp2p's logging through the node's set-up: a connection cancelled as the host closes
logs no traceback (libp2p logs it as ``[ADDCONN_FAIL]`` with one); other failures do."""

from __future__ import annotations

import logging

import pytest
import trio

from atoll.node.net.host import _configure_libp2p_logging


def _a_cancelled() -> BaseException:
    caught: list[BaseException] = []

    async def main() -> None:
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                await trio.sleep(1)
            except trio.Cancelled as e:
                caught.append(e)
                raise

    trio.run(main)
    return caught[0]


def test_a_connection_cancelled_at_close_logs_no_traceback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LIBP2P_DEBUG", raising=False)
    _configure_libp2p_logging()
    lg = logging.getLogger("libp2p.network.swarm")
    msg = "[ADDCONN_FAIL] add_conn failed for peer %s: %s"
    with caplog.at_level(logging.WARNING):
        for exc in (_a_cancelled(), ValueError("boom")):
            try:
                raise exc
            except BaseException:
                lg.warning(msg, "peer", type(exc).__name__, exc_info=True)
    logged = {r.getMessage() for r in caplog.records if r.name == lg.name}
    assert logged == {"[ADDCONN_FAIL] add_conn failed for peer peer: ValueError"}, logged
