"""Debug logs for chosen parts of a node: ``ATOLL_DEBUG``.

``atoll -vv`` puts every logger at DEBUG, libp2p's and trio's included: logs of many
megabytes a minute, written by the same processes whose timing a fault lab measures.
``ATOLL_DEBUG=atoll.node.net.rounds,atoll.dht`` instead lowers only the named loggers (and
their children) to DEBUG, in the trainer and in its network process, whatever ``-v`` set
for the rest. Names that are not loggers of the node are accepted and log nothing.
"""

from __future__ import annotations

import logging
import os

__all__ = ["ENV", "debug_from_env"]

ENV = "ATOLL_DEBUG"


def debug_from_env() -> list[str]:
    """Set the loggers named in ``ATOLL_DEBUG`` (comma-separated) to DEBUG; their names."""
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    for name in names:
        logging.getLogger(name).setLevel(logging.DEBUG)
    return names
