"""What the round drivers need of the network: a message transport and a board of ready peers.

:mod:`atoll.node.net.rounds` drives the sans-IO round machines over two small seams, so
that the same drivers run over the live network and in memory:

- :class:`RoundTransport`: this node's id, ``send`` a wire message to a peer, ``receive``
  the next message from any peer. :class:`~atoll.node.net.host.AtollHost` is one;
  :class:`~atoll.node.net.memory.MemoryTransport` another.
- :class:`ReadyBoard`: publish this node's :class:`~atoll.dht.records.ReadyRecord` and
  list the ready records of a fragment's slot.
  :class:`~atoll.dht.kad.AtollDHT` is one; :class:`~atoll.node.net.memory.MemoryBoard`
  another.

Both are structural (:class:`typing.Protocol`): nothing inherits from them. Their
parameters are positional-only, so an implementation may name them as it likes. The
static checks at the bottom of this module make ``make typecheck`` fail if the live
classes stop fitting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from atoll.dht.records import ReadyRecord

__all__ = ["ReadyBoard", "RoundTransport"]


class RoundTransport(Protocol):
    """Sends and receives one node's wire messages (authenticated peer ids).

    ``send`` delivers ``msg`` to ``peer`` or raises: :class:`~atoll.protocol.errors.
    PeerUnavailable` (the peer cannot be reached, the write failed or timed out),
    :class:`~atoll.protocol.errors.ExchangeTimeout` or another
    :class:`~atoll.protocol.errors.AtollError` (a message that cannot be encoded, a peer id
    that is not one). Its own duration is bounded by the implementation.

    ``receive`` returns the next ``(sender, message)`` from any peer, ``sender`` being the
    authenticated peer, not the message's own ``sender`` field; it raises
    ``trio.EndOfChannel`` or ``trio.ClosedResourceError`` once the transport is closed.
    """

    @property
    def peer_id(self) -> str:
        """This node's peer id."""
        ...

    async def send(self, peer: str, msg: object, /) -> None:
        """Send ``msg`` to ``peer`` (see the class docstring for the errors)."""
        ...

    async def receive(self) -> tuple[str, object]:
        """The next ``(authenticated sender, message)`` (see the class docstring)."""
        ...


class ReadyBoard(Protocol):
    """Where peers declare that they are ready for a fragment's slot, and look each other up.

    ``announce_ready`` publishes this node's record until its ``expires_at``;
    ``find_ready`` lists the valid (unexpired) records of this node's run for ``fragment``
    and ``slot``. Both may raise :class:`~atoll.protocol.errors.AtollError` (a lookup that
    timed out, nobody to ask); the drivers log it and poll again.
    """

    async def announce_ready(self, record: ReadyRecord, /) -> None:
        """Publish ``record`` (see the class docstring)."""
        ...

    async def find_ready(self, fragment: int, slot: int, /) -> list[ReadyRecord]:
        """The valid ready records of ``fragment``'s ``slot`` (see the class docstring)."""
        ...


if TYPE_CHECKING:  # static checks only: the live classes must keep fitting the seams
    from atoll.dht.kad import AtollDHT
    from atoll.node.net.host import AtollHost

    def _host_is_a_transport(host: AtollHost) -> RoundTransport:
        return host

    def _dht_is_a_board(dht: AtollDHT) -> ReadyBoard:
        return dht
