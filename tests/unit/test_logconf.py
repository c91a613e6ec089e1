"""ATOLL_DEBUG: the named loggers, and only those, at DEBUG (node/logconf.py)."""

from __future__ import annotations

import logging

import pytest

from atoll.node.logconf import ENV, debug_from_env


def test_only_the_named_loggers_go_to_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["atoll.test_logconf.a", "atoll.test_logconf.b"]
    other = logging.getLogger("atoll.test_logconf.c")
    for n in [*names, other.name]:
        logging.getLogger(n).setLevel(logging.NOTSET)
    monkeypatch.setenv(ENV, f" {names[0]},,{names[1]} ")
    assert debug_from_env() == names
    assert all(logging.getLogger(n).level == logging.DEBUG for n in names)
    assert logging.getLogger(names[0] + ".child").isEnabledFor(logging.DEBUG)
    assert other.level == logging.NOTSET
    monkeypatch.delenv(ENV)
    assert debug_from_env() == []
