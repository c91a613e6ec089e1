"""The swarm as one DHT peer sees it: the status protocol behind ``atoll status``.

Kademlia cannot list what it stores (a reader must know a key), so a peer's view of the
swarm is read from the peer itself: every atoll DHT peer (bootstrap peers and nodes)
answers a stream of :data:`STATUS_PROTOCOL` (``/atoll/status/1.0.0``) with the sealed
:class:`~atoll.dht.records.PeerRecord` values it stores, of every run, and closes it.

Nothing in the answer is trusted: the asker opens every value with its own verifier and
clock (:func:`~atoll.dht.records.decode_value`: seal, signer, key, expiry) and drops what
fails, so a lying peer can hide records but not forge them. Peer records are public in
the DHT anyway (anyone who knows a peer id can read them); ready and state records are not
listed. Limits: at most :data:`MAX_RECORDS` records and :data:`MAX_ANSWER_BYTES` bytes per
answer, the exchange bounded by the asker's timeout.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgpack
import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol

from atoll.dht.directory import Clock
from atoll.dht.keys import PeerKey, parse_key
from atoll.dht.peeraddr import parse_peer_addr
from atoll.dht.records import PeerRecord, RecordVerifier, RejectedRecord, decode_value
from atoll.protocol.errors import CodecError, ExchangeTimeout, PeerUnavailable

__all__ = ["MAX_ANSWER_BYTES", "MAX_RECORDS", "STATUS_PROTOCOL", "fetch_status", "serve_status"]

logger = logging.getLogger(__name__)

STATUS_PROTOCOL = TProtocol("/atoll/status/1.0.0")
MAX_RECORDS = 2000
MAX_ANSWER_BYTES = 16 * 1024 * 1024


def stored_peer_values(store: Any) -> list[tuple[str, bytes]]:
    """``(key, sealed value)`` of the peer records in a libp2p value store (unvalidated)."""
    out: list[tuple[str, bytes]] = []
    for key_bytes, (record, _) in list(store.store.items()):
        try:
            key = key_bytes.decode("utf-8")
            if not isinstance(parse_key(key), PeerKey):
                continue
        except (UnicodeDecodeError, CodecError):
            continue
        out.append((key, bytes(record.value)))
        if len(out) >= MAX_RECORDS:
            break
    return out


def serve_status(host: IHost, store: Any, timeout_s: float = 10.0) -> None:
    """Answer :data:`STATUS_PROTOCOL` streams on ``host`` from the value ``store``."""

    async def handler(stream: INetStream) -> None:
        try:
            with trio.move_on_after(timeout_s):
                data = msgpack.packb(stored_peer_values(store))
                await stream.write(data[:MAX_ANSWER_BYTES])
                await stream.close()
        except Exception as e:  # the asker went away: nothing to do
            logger.debug("status answer failed: %s", e)
            with contextlib.suppress(Exception):
                await stream.reset()

    host.set_stream_handler(STATUS_PROTOCOL, handler)


async def fetch_status(
    host: IHost,
    addr: str,
    *,
    verifier: RecordVerifier,
    clock: Clock,
    timeout_s: float = 10.0,
) -> list[PeerRecord]:
    """The valid peer records the peer at ``addr`` stores, sorted by run and peer id.

    Raises ConfigError on a malformed address, :class:`PeerUnavailable` when the peer
    cannot be reached or does not serve the status protocol, ExchangeTimeout when the
    answer takes over ``timeout_s``.
    """
    info = parse_peer_addr(addr)
    chunks: list[bytes] = []
    with trio.move_on_after(timeout_s) as scope:
        try:
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [STATUS_PROTOCOL])
        except Exception as e:
            raise PeerUnavailable(f"{addr}: unreachable or not an atoll peer ({e})") from None
        size = 0
        while True:
            try:
                data = await stream.read(1 << 16)
            except Exception:  # EOF or reset: the answer is complete (or cut short)
                break
            if not data:
                break
            chunks.append(data)
            size += len(data)
            if size > MAX_ANSWER_BYTES:
                raise PeerUnavailable(f"{addr}: status answer over {MAX_ANSWER_BYTES} bytes")
    if scope.cancelled_caught:
        raise ExchangeTimeout(f"{addr}: no status answer within {timeout_s} s")
    try:
        items = msgpack.unpackb(b"".join(chunks))
    except Exception as e:
        raise PeerUnavailable(f"{addr}: the status answer does not decode ({e})") from None
    if not isinstance(items, list):
        raise PeerUnavailable(f"{addr}: the status answer is not a list")
    records: list[PeerRecord] = []
    now = clock.wall()
    for item in items[:MAX_RECORDS]:
        if not (isinstance(item, list) and len(item) == 2):
            continue
        key, value = item
        if not isinstance(key, str) or not isinstance(value, bytes):
            continue
        try:
            record = decode_value(value, key=key, now=now, verifier=verifier)
        except (RejectedRecord, CodecError) as e:
            logger.info("status of %s: dropped a record under %s: %s", addr, key, e)
            continue
        if isinstance(record, PeerRecord):
            records.append(record)
    return sorted(records, key=lambda r: (r.run_id, r.peer_id))
