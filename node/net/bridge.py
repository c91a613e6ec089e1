"""The bridge between the trainer and the node's network process.

The training loop is plain synchronous PyTorch in the node's main process; all networking
runs in one trio event loop in a *separate* process (docs/DESIGN.md, "Concurrency": a
trio thread inside the trainer cut its step rate to 10-27% during a bulk transfer). The
:class:`~atoll.protocol.engine.OuterEngine` lives in the network process: it owns the
global copies and the outer optimizer states, encodes, exchanges and applies the outer
step. The trainer only copies fragment values in and out of shared memory, so a training
step never pays for encoding or networking.

Pieces
------
- :class:`SharedFragments`: one shared-memory block per fragment holding two float32
  vectors, ``local`` (the trainer writes it at the fragment's sync step) and ``global_``
  (the network process writes the new global copy there after an applied round; before
  the network process starts, the trainer writes the initial global copies there).
- :class:`NetworkBridge` (trainer side): starts the network process (``spawn``) running a
  *worker*, ``"module:function"`` naming ``async def main(shared, inbox, outbox,
  **worker_args)`` run with :func:`trio.run`, and talks to it over two one-way pipes
  carrying small msgpack commands.
- :class:`WarmWorker`: the network process started before its arguments are known. It
  imports the worker's module (py-libp2p alone took 3 s of a 5.6 s import on a busy
  2-core machine) while the trainer loads its data, builds its model and reads its
  checkpoint, then waits for the bridge's ``go``: the shared memory's names and the
  worker's arguments. A restarted node trains that much sooner. The node daemon starts
  one first thing; a bridge given none starts its own.
- :func:`serve` (network side): the command loop a worker runs; it hands every started
  sync to the worker's handler in a nursery and sends the outcomes back.
- :func:`local_engine_worker`: the reference worker: an OuterEngine with a loopback
  exchange (a group of one), optional delay, injected failures and CPU load. Tests use it;
  the swarm worker plugs in the same way.

Ownership of the shared vectors
-------------------------------
Between :meth:`NetworkBridge.start_sync` for fragment ``p`` and the moment its outcome is
handed to the trainer (by :meth:`~NetworkBridge.wait` or :meth:`~NetworkBridge.poll`),
``local(p)`` and ``global_(p)`` belong to the network process: the trainer must neither
write them nor read ``global_(p)`` (:meth:`NetworkBridge.in_flight` says when). After an
outcome with ``applied=True``, ``global_(p)`` holds the new global copy and the trainer
merges it into its parameters (:func:`atoll.protocol.engine.merge`).

A wait that times out (``Timeouts.apply_wait_s``) returns ``None`` and the trainer goes
on without the result; the round itself goes on in the network process and its outcome
arrives later through :meth:`~NetworkBridge.poll` (a late applied round is still the
swarm's new global copy and may be merged late). The bridge's calls are what the trainer's
:class:`~atoll.protocol.streaming.StreamingLoop` needs of an exchange (the daemon adds the
copies to and from shared memory); :class:`SyncOutcome` is the loop's.

Commands (msgpack arrays)::

    trainer -> network   ["start", fragment, step, tokens]   ["shutdown"]
                         ["snapshot", path]   (copy the engine's state for a checkpoint
                                               and write it to path)
    network -> trainer   ["ready"]   ["outcome", fragment, step, applied, round, reason, met_at]
                         ["hold", fragment, seconds]   (the sync waits for peers due
                                                        at its slot; 0 releases)
                         ["status", {field: value}]   (the whole NodeStatus, wire form;
                                                       becomes NetworkBridge.status)
                         ["info", {field: value}]   (the older partial form: the fields
                                                     it names update NetworkBridge.status)
                         ["snapshot", path, ok, detail, scalars]   (the answer: the
                                               engine's arrays are in path)
                         ["error", text]   (the worker failed; the process then exits)

Errors (added to the tree of :mod:`atoll.protocol.errors`)::

    AtollError
    └── NetworkProcessError   the network process failed, or the bridge is closed
        ├── NetworkStartError the process did not start and report ready in time
        └── NetworkProcessDied the process exited while the bridge was open

The process is a daemon child that ignores SIGINT and SIGUSR1 (the trainer decides when
it stops); it exits on ``shutdown`` or when the trainer's end of the command pipe closes
(the trainer died). Shared memory is created and unlinked by the trainer; the child only attaches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgpack
import numpy as np
import trio

from atoll.node.logconf import debug_from_env
from atoll.node.net.heap import keep_freed_memory
from atoll.node.net.status import BadStatus, NodeStatus
from atoll.protocol import allreduce as ar
from atoll.protocol.engine import EngineConfig, OuterEngine, SyncRequest, average_requests
from atoll.protocol.errors import AtollError, ConfigError
from atoll.protocol.schedule import Schedule
from atoll.protocol.streaming import SyncOutcome
from atoll.protocol.sync import FragmentSync, SyncDone

__all__ = [
    "BridgeStats",
    "NetworkBridge",
    "NetworkProcessDied",
    "NetworkProcessError",
    "NetworkStartError",
    "Settled",
    "SharedFragments",
    "SnapshotReply",
    "SyncOutcome",
    "WarmWorker",
    "local_engine_worker",
    "post_status",
    "serve",
]

log = logging.getLogger(__name__)

DIED = "network process died"
"""the reason of the outcomes of rounds in flight when the network process exits"""
MAX_HOLD_S = 120.0
"""the longest a hold keeps the trainer waiting (the network process asks for at most
its matchmaking deadline; this bounds a faulty one)"""
_MAX_MESSAGE = 1 << 16  # commands are tiny; anything larger is a bug
_F32 = np.dtype(np.float32)


class NetworkProcessError(AtollError):
    """The network process failed, or the bridge is already closed."""


class NetworkStartError(NetworkProcessError):
    """The network process did not start and report ready in time."""


class NetworkProcessDied(NetworkProcessError):
    """The network process exited while the bridge was open."""


@dataclass(slots=True)
class BridgeStats:
    """Trainer-side counters of a bridge (never reset)."""

    started: int = 0
    applied: int = 0
    """outcomes received with applied=True (late ones included)"""
    failed: int = 0
    """outcomes received with applied=False"""
    skipped: int = 0
    """waits that ran out: the trainer went on without the round's result"""
    wait_s: float = 0.0
    """seconds the trainer spent blocked in :meth:`NetworkBridge.wait`"""
    held: int = 0
    """waits made longer than asked by a hold (the node was ahead of its peers)"""


# -- shared memory --------------------------------------------------------------------------
class SharedFragments:
    """Per fragment, one shared-memory block: ``local`` then ``global_``, float32 each.

    The trainer :meth:`create`\\ s (and in the end :meth:`unlink`\\ s) the blocks; the
    network process :meth:`attach`\\ es to them by name. Views returned by :meth:`local`
    and :meth:`global_` are valid until :meth:`close`.
    """

    def __init__(
        self, blocks: Sequence[SharedMemory], sizes: Sequence[int], *, owner: bool
    ) -> None:
        self._blocks = list(blocks)
        self.sizes: tuple[int, ...] = tuple(int(n) for n in sizes)
        self.names: list[str] = [b.name for b in self._blocks]
        self._owner = owner
        self._local: list[np.ndarray] = []
        self._global: list[np.ndarray] = []
        for block, n in zip(self._blocks, self.sizes, strict=True):
            self._local.append(np.ndarray((n,), _F32, buffer=block.buf, offset=0))
            self._global.append(np.ndarray((n,), _F32, buffer=block.buf, offset=4 * n))
        self._closed = False

    @staticmethod
    def _check_sizes(sizes: Sequence[int]) -> list[int]:
        out = [int(n) for n in sizes]
        if not out or any(n < 1 for n in out):
            raise ConfigError(f"shared fragments need sizes >= 1, not {list(sizes)[:8]}")
        return out

    @classmethod
    def create(cls, sizes: Sequence[int], *, name_prefix: str | None = None) -> SharedFragments:
        """New zero-filled blocks, one per fragment (the trainer's side; it unlinks them)."""
        ns = cls._check_sizes(sizes)
        prefix = name_prefix or f"atoll-{os.getpid()}-{secrets.token_hex(4)}"
        blocks: list[SharedMemory] = []
        try:
            for p, n in enumerate(ns):
                blocks.append(SharedMemory(name=f"{prefix}-{p}", create=True, size=8 * n))
        except BaseException as e:
            for b in blocks:
                b.close()
                b.unlink()
            if isinstance(e, FileExistsError):
                raise ConfigError(f"shared memory {prefix!r} exists already") from None
            if isinstance(e, OSError):
                raise ConfigError(f"cannot create shared memory {prefix!r}: {e}") from None
            raise
        return cls(blocks, ns, owner=True)

    @classmethod
    def attach(cls, names: Sequence[str], sizes: Sequence[int]) -> SharedFragments:
        """Attach to blocks created by :meth:`create` (the network process's side)."""
        ns = cls._check_sizes(sizes)
        if len(names) != len(ns):
            raise ConfigError(f"{len(names)} shared-memory names for {len(ns)} sizes")
        blocks: list[SharedMemory] = []
        try:
            for name, n in zip(names, ns, strict=True):
                block = SharedMemory(name=name)
                blocks.append(block)
                if block.size < 8 * n:
                    raise ConfigError(
                        f"shared memory {name!r} holds {block.size} bytes, needs {8 * n}"
                    )
        except BaseException as e:
            for b in blocks:
                b.close()
            if isinstance(e, FileNotFoundError):
                raise ConfigError(f"no shared memory named {e.filename or names}") from None
            raise
        return cls(blocks, ns, owner=False)

    def __len__(self) -> int:
        return len(self._blocks)

    def local(self, p: int) -> np.ndarray:
        """Fragment ``p``'s local vector (the trainer writes it before starting a sync)."""
        return self._local[p]

    def global_(self, p: int) -> np.ndarray:
        """Fragment ``p``'s global vector (the network process writes it after a round)."""
        return self._global[p]

    def close(self) -> None:
        """Unmap the blocks in this process (views held elsewhere keep them mapped)."""
        if self._closed:
            return
        self._closed = True
        self._local.clear()
        self._global.clear()
        for b in self._blocks:
            try:
                b.close()
            except BufferError:  # a caller still holds a view: the mapping lives on with it
                log.warning("shared memory %s still has views; left mapped", b.name)

    def unlink(self) -> None:
        """Remove the blocks' names (the owner does this once, after the child is gone)."""
        for b in self._blocks:
            with contextlib.suppress(FileNotFoundError):
                b.unlink()

    def __enter__(self) -> SharedFragments:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            self.unlink()


# -- wire of the control pipes --------------------------------------------------------------
def _send(conn: Connection, msg: Sequence[Any]) -> None:
    conn.send_bytes(msgpack.packb(list(msg)))


def _decode(data: bytes) -> list[Any]:
    msg = msgpack.unpackb(data)
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
        raise ValueError(f"not a bridge command: {msg!r:.80}")
    return msg


def _outcome_msg(o: SyncOutcome) -> list[Any]:
    return ["outcome", o.fragment, o.step, o.applied, o.round, o.reason, o.met_at]


# -- network process side -------------------------------------------------------------------
Handler = Callable[[int, int, int], Awaitable[SyncOutcome]]


@dataclass(frozen=True, slots=True)
class Settled:
    """How the end-of-run settle went: ``agreed`` when every peer that answers holds this
    node's global copy of every fragment; ``detail`` says what was done or what is left."""

    agreed: bool
    detail: str


SettleHandler = Callable[[float], Awaitable[Settled]]
"""``await settle(timeout_s)``: bring every fragment onto the swarm's copy (network side)."""

StepHandler = Callable[[int, bool], None]
"""``on_step(step, moved)``: the trainer's current inner step (network side); ``moved``
when the trainer jumped or moved there rather than trained."""

SnapshotHandler = Callable[[str], Awaitable[Callable[[], dict[str, Any]]]]
"""``await snapshot(path)`` copies the engine's state (under the engine's lock; the
command loop reads no further command meanwhile, so no later sync changes it) and
returns the writer, run off the event loop, that writes the copy to ``path`` and returns
its scalars (network side)."""


@dataclass(frozen=True, slots=True)
class SnapshotReply:
    """The network process's answer to a snapshot request (trainer side)."""

    ok: bool
    detail: str
    meta: dict[str, Any]
    """the engine's scalars (:func:`atoll.node.snapshot.engine_arrays`) when ``ok``"""


async def _receive(inbox: Connection) -> list[Any] | None:
    """The next command, without blocking the loop; None when the trainer's end closed."""
    while True:
        try:
            if inbox.poll():  # commands are written whole, so a readable pipe holds one
                return _decode(inbox.recv_bytes(_MAX_MESSAGE))
        except (EOFError, OSError):
            return None
        except ValueError as e:  # not msgpack, or not a command: a bug on the other side
            log.warning("dropped a malformed bridge command: %s", e)
            continue
        await trio.lowlevel.wait_readable(inbox.fileno())


async def serve(
    inbox: Connection,
    outbox: Connection,
    handler: Handler,
    settle: SettleHandler | None = None,
    on_step: StepHandler | None = None,
    snapshot: SnapshotHandler | None = None,
) -> None:
    """Run the bridge's command loop until ``shutdown`` or until the trainer goes away.

    Sends ``ready`` first. Each ``start`` runs ``handler(fragment, step, tokens)`` in a
    nursery (one sync in flight per fragment; a second start of the same fragment is
    answered with a failed outcome). A handler raising :class:`AtollError` yields a
    failed outcome with the error as reason; any other exception ends the process.
    ``settle`` (a ``["settle", timeout_s]`` command, at the end of a run) first waits for
    the syncs in flight, then runs ``settle(time left)`` and answers ``["settled",
    agreed, detail]``; without a handler the answer is agreed at once. ``["step", n]``
    (the trainer's current step, now and then) goes to ``on_step``. ``["snapshot",
    path]`` copies the engine's state through ``snapshot`` before the next command is
    read, writes it in a thread and answers ``["snapshot", path, ok, detail, scalars]``.
    """
    in_flight: set[int] = set()
    idle = trio.Event()  # set whenever no sync is in flight
    idle.set()
    gone = trio.Event()

    def send(msg: Sequence[Any]) -> None:
        try:
            _send(outbox, msg)
        except OSError:  # the trainer closed its end or died
            gone.set()

    async def run_one(p: int, step: int, tokens: int) -> None:
        try:
            outcome = await handler(p, step, tokens)
        except AtollError as e:
            outcome = SyncOutcome(p, step, False, -1, f"{type(e).__name__}: {e}")
        finally:
            in_flight.discard(p)
            if not in_flight:
                idle.set()
        send(_outcome_msg(outcome))

    async def run_settle(timeout_s: float) -> None:
        deadline = trio.current_time() + timeout_s
        with trio.move_on_at(deadline):
            await idle.wait()  # the last syncs end within their own timeouts
        left = deadline - trio.current_time()
        if in_flight:
            result = Settled(False, f"syncs of fragments {sorted(in_flight)} still in flight")
        elif settle is None:
            result = Settled(True, "nothing to settle")
        else:
            try:
                result = await settle(max(0.0, left))
            except AtollError as e:
                result = Settled(False, f"{type(e).__name__}: {e}")
        send(["settled", result.agreed, result.detail])

    async def run_snapshot(path: str, write: Callable[[], dict[str, Any]]) -> None:
        try:
            meta = await trio.to_thread.run_sync(write)
        except Exception as e:  # a full disk, a bug: the trainer logs it, training goes on
            send(["snapshot", path, False, f"{type(e).__name__}: {e}", {}])
            return
        send(["snapshot", path, True, "", meta])

    async with trio.open_nursery() as nursery:

        async def watch_gone() -> None:
            await gone.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch_gone)
        send(["ready"])
        while True:
            msg = await _receive(inbox)
            if msg is None:
                log.info("the trainer closed the bridge; the network process stops")
                break
            if msg[0] == "shutdown":
                break
            if msg[0] == "start" and len(msg) == 4:
                p, step, tokens = (int(v) for v in msg[1:])
                if p in in_flight:
                    send(_outcome_msg(SyncOutcome(p, step, False, -1, "a sync is in flight")))
                    continue
                in_flight.add(p)
                if idle.is_set():  # a waiter on the current event stays valid otherwise
                    idle = trio.Event()
                nursery.start_soon(run_one, p, step, tokens)
            elif msg[0] == "settle" and len(msg) == 2:
                nursery.start_soon(run_settle, float(msg[1]))
            elif msg[0] == "step" and len(msg) in (2, 3):
                if on_step is not None:
                    on_step(int(msg[1]), bool(msg[2]) if len(msg) == 3 else False)
            elif msg[0] == "snapshot" and len(msg) == 2:
                path = str(msg[1])
                if snapshot is None:
                    send(["snapshot", path, False, "this worker keeps no engine state", {}])
                    continue
                try:
                    write = await snapshot(path)  # the copy, before any later command
                except Exception as e:
                    send(["snapshot", path, False, f"{type(e).__name__}: {e}", {}])
                    continue
                nursery.start_soon(run_snapshot, path, write)
            else:
                log.warning("unknown bridge command %r", msg[:1])
        nursery.cancel_scope.cancel()


def _child_main(worker: str, inbox: Connection, outbox: Connection, log_level: int) -> None:
    """Entry point of the network process (spawned). It imports ``worker``'s module at
    once, then waits for the trainer's ``go`` (the shared memory's names and sizes and the
    worker's arguments: see :class:`WarmWorker`); a trainer that went away first (the pipe
    ends) ends it quietly."""
    # the trainer decides when this stops (a Ctrl+C or a finish request sent to the whole
    # process group is the trainer's)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s net[%(process)d] %(name)s %(levelname)s %(message)s"
    )
    debug_from_env()
    shared: SharedFragments | None = None
    code = 0
    try:
        keep_freed_memory()  # each round reuses the pages of the one before
        module, _, attr = worker.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        try:
            go = inbox.recv()  # the trainer's own pickle, from its own pipe
        except (EOFError, OSError):
            os._exit(0)  # the trainer went away before it needed this process
        _, names, sizes, worker_args = go
        shared = SharedFragments.attach(names, sizes)
        trio.run(functools.partial(fn, shared, inbox, outbox, **worker_args))
    except BaseException as e:
        code = 1
        if isinstance(e, AtollError):
            # a reason for the user (join failed, bad address), not a bug: the trainer
            # reports it; the text goes as it is
            text = str(e)
            log.info("network worker %s stopped: %s", worker, text)
        else:
            text = "".join(traceback.format_exception_only(type(e), e)).strip()
            log.error("network worker %s failed: %s", worker, text, exc_info=True)
        with contextlib.suppress(OSError):
            _send(outbox, ["error", text])
    finally:
        if shared is not None:
            shared.close()
    # everything this process owns is closed: skip the interpreter's teardown (seconds on
    # a busy machine), which the trainer's exit would wait for
    logging.shutdown()
    os._exit(code)


# -- trainer side ---------------------------------------------------------------------------
class WarmWorker:
    """A network process started before its arguments are known: it imports ``worker``'s
    module (libp2p, trio, the DHT: several seconds on a busy machine) while the trainer
    loads its data, builds its model and reads its checkpoint, and waits for the
    :class:`NetworkBridge` that takes it. Close it when no bridge took it (a failed
    start); closing one that a bridge took does nothing."""

    def __init__(self, worker: str) -> None:
        if ":" not in worker:
            raise ConfigError(f"worker must be 'module:function', not {worker!r}")
        self.worker = worker
        self.taken = False
        ctx = multiprocessing.get_context("spawn")
        cmd_r, self.cmd = ctx.Pipe(duplex=False)
        self.out, out_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_child_main,
            args=(worker, cmd_r, out_w, logging.getLogger().getEffectiveLevel()),
            name=f"atoll-net-{os.getpid()}",
            daemon=True,
        )
        try:
            self.proc.start()
        except BaseException as e:
            self.cmd.close()
            self.out.close()
            raise NetworkStartError(f"cannot start the network process: {e!r}") from e
        finally:
            cmd_r.close()  # the child has its own copies; EOF now means the other side died
            out_w.close()

    def go(self, shared: SharedFragments, worker_args: dict[str, Any]) -> None:
        """Hand the process its shared memory and arguments (once, by the bridge)."""
        if self.taken:
            raise ConfigError("this network process was handed to a bridge already")
        self.taken = True
        # a process that failed already (its import, say) said why on its way out: the
        # bridge reads that next, so a closed pipe here is not the error to report
        with contextlib.suppress(OSError):
            self.cmd.send(["go", list(shared.names), list(shared.sizes), dict(worker_args)])

    def close(self) -> None:
        """End a process no bridge took (it holds nothing yet: it is killed)."""
        if self.taken:
            return
        self.taken = True
        with contextlib.suppress(OSError):
            self.cmd.close()
        if self.proc.is_alive():  # nothing of it to clean up: no memory attached, no host
            self.proc.kill()
        self.proc.join(5.0)
        with contextlib.suppress(OSError):
            self.out.close()

    def __enter__(self) -> WarmWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetworkBridge:
    """The trainer's handle on the network process: start syncs, collect their outcomes.

    Starting blocks until the worker reports ready (at most ``start_timeout_s``) and
    raises :class:`NetworkStartError` when it does not. ``worker_args`` are pickled to the
    child. ``warm``: a process started earlier for ``worker`` (:class:`WarmWorker`),
    taken over instead of starting one. Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        shared: SharedFragments,
        worker: str,
        worker_args: dict[str, Any] | None = None,
        *,
        start_timeout_s: float = 30.0,
        warm: WarmWorker | None = None,
    ) -> None:
        if ":" not in worker:
            raise ConfigError(f"worker must be 'module:function', not {worker!r}")
        if warm is not None and warm.worker != worker:
            raise ConfigError(f"the warm network process runs {warm.worker}, not {worker}")
        self.shared = shared
        self.worker = worker
        self.stats = BridgeStats()
        self._pending: dict[int, int] = {}  # fragment -> step, started and not yet finished
        self._finished: dict[int, SyncOutcome] = {}  # received, not yet handed out
        self._holds: dict[int, float] = {}  # fragment -> monotonic time a hold ends
        self._dead: str | None = None
        self._closed = False
        self._settled: Settled | None = None
        self._snapshots: dict[str, SnapshotReply | None] = {}  # asked -> answer (None: not yet)
        # interrupt(), from a signal handler, wakes a wait through this pipe
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._interrupted = False
        self._step_sent_at = -float("inf")
        self.status = NodeStatus()
        """the latest status the network process sent (peer id, peers, bytes, rounds)"""
        if warm is None:
            warm = WarmWorker(worker)
        self._proc, self._cmd, self._out = warm.proc, warm.cmd, warm.out
        warm.go(shared, dict(worker_args or {}))
        try:
            self._await_ready(start_timeout_s)
        except BaseException:
            # a worker that reported its error (a failed join, say) has closed its host and
            # exits at once (without the interpreter's teardown: see _child_main)
            self.close(timeout_s=1.0)
            raise

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NetworkStartError(
                    f"network worker {self.worker} did not report ready within {timeout_s} s"
                )
            multiprocessing.connection.wait([self._out, self._proc.sentinel], left)
            try:
                if self._out.poll():
                    msg = _decode(self._out.recv_bytes(_MAX_MESSAGE))
                    if msg[0] == "ready":
                        return
                    if msg[0] in ("status", "info"):
                        self._take_status(msg)
                        continue
                    if msg[0] == "error":
                        raise NetworkStartError(str(msg[1]))
                    raise NetworkStartError(f"unexpected first message {msg[:1]!r}")
            except (EOFError, OSError):
                pass
            if not self._proc.is_alive():
                raise NetworkStartError(
                    f"network process exited with code {self._proc.exitcode} before ready"
                )

    # -- queries -------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._closed and self._dead is None and self._proc.is_alive()

    def note_step(self, step: int, *, every_s: float = 0.5, moved: bool = False) -> None:
        """Tell the network process the trainer's current step (at most every
        ``every_s``; at once when ``moved``: the trainer jumped or moved there): a peer
        that copies a state from this node starts at this step, so its syncs line up with
        the swarm's. Never blocks; a broken pipe is noticed later."""
        now = time.monotonic()
        if moved:
            every_s = 0.0
        if now - self._step_sent_at < every_s or self._dead is not None or self._closed:
            return
        self._step_sent_at = now
        with contextlib.suppress(OSError):
            _send(self._cmd, ["step", int(step), bool(moved)])

    def in_flight(self, fragment: int) -> bool:
        """A sync of ``fragment`` was started and its outcome not yet handed out."""
        return fragment in self._pending or fragment in self._finished

    # -- the calls of the training loop --------------------------------------------------
    def start_sync(self, fragment: int, step: int, tokens: int) -> None:
        """Start fragment's sync; the trainer has written ``shared.local(fragment)``.

        ``tokens`` is the trainer's total count of tokens trained on so far (the weight of
        its contribution is what it grew by since the fragment's last applied round).
        Never blocks on the network.
        """
        self._check_usable()
        if not 0 <= fragment < len(self.shared):
            raise ConfigError(f"no fragment {fragment} (there are {len(self.shared)})")
        if self.in_flight(fragment):
            raise ConfigError(
                f"fragment {fragment} has a sync in flight or an outcome not yet collected"
            )
        try:
            _send(self._cmd, ["start", int(fragment), int(step), int(tokens)])
        except OSError:
            self._mark_dead("its command pipe broke")
            self._check_usable()
        self._pending[fragment] = int(step)
        self._holds.pop(fragment, None)
        self.stats.started += 1

    def poll(self) -> list[SyncOutcome]:
        """Outcomes that arrived and were not handed out yet; never blocks."""
        if self._closed:
            raise NetworkProcessError("the bridge is closed")
        self._drain(0.0)
        if not self._finished:
            self._check_usable()
            return []
        out = list(self._finished.values())
        self._finished.clear()
        return out

    def wait(self, fragment: int, timeout_s: float) -> SyncOutcome | None:
        """Block until fragment's outcome arrives, at most ``timeout_s`` seconds, or
        longer while the network process holds the fragment.

        A hold (``["hold", fragment, seconds]``) says the sync still waits for peers due
        at its slot, which have not arrived: this node is ahead of them. Waiting with it
        (at most :data:`MAX_HOLD_S`, until the hold is released or the outcome comes)
        brings the node back in step with the swarm, where training on would have it
        arrive first, and miss them, at every later slot as well.

        ``None``: not finished in time; the trainer goes on without it (counted in
        ``stats.skipped``) and the outcome comes later through :meth:`poll`. When the
        network process dies meanwhile, the outcome is ``applied=False`` with reason
        :data:`DIED`, and later calls raise :class:`NetworkProcessDied`.
        """
        if self._closed:
            raise NetworkProcessError("the bridge is closed")
        if fragment not in self._finished and fragment not in self._pending:
            self._check_usable()
            raise ConfigError(f"fragment {fragment} has no sync in flight")
        t0 = time.monotonic()
        asked = t0 + max(0.0, timeout_s)
        held = False
        try:
            while True:
                self._drain(0.0)
                if fragment in self._finished:
                    return self._finished.pop(fragment)
                now = time.monotonic()
                deadline = max(asked, self._holds.get(fragment, 0.0))  # capped when set
                if deadline > asked and not held:
                    held = True
                    log.info(
                        "fragment %d: its peers have not reached the slot yet; the trainer "
                        "waits up to %.0f s for them",
                        fragment,
                        deadline - now,
                    )
                left = deadline - now
                if left <= 0 or self._interrupted:
                    self.stats.skipped += 1
                    return None
                self._drain(left)  # a hold or its release wakes this up too
                if fragment in self._finished:
                    return self._finished.pop(fragment)
        finally:
            end = time.monotonic()
            self.stats.wait_s += end - t0
            self.stats.held += held and end > asked

    def interrupt(self) -> None:
        """The trainer is stopping (a signal handler may call this): a wait in progress
        returns at once with no outcome, later waits do not block, holds are dropped."""
        self._interrupted = True
        self._holds.clear()
        with contextlib.suppress(OSError):  # a full pipe is woken already
            os.write(self._wake_w, b"!")

    def settle(self, timeout_s: float) -> Settled:
        """At the end of a run: have the network process bring every fragment onto the
        swarm's copy (its syncs in flight end first; then a rebase where the peers hold
        another copy, until every peer that answers holds this node's). Blocks at most
        ``timeout_s`` plus a few seconds; outcomes that arrive meanwhile wait for
        :meth:`poll`. Never raises for the network's sake: the answer says what happened.
        """
        self._check_usable()
        self._settled = None
        try:
            _send(self._cmd, ["settle", float(timeout_s)])
        except OSError:
            self._mark_dead("its command pipe broke")
            return Settled(False, "the network process is gone")
        deadline = time.monotonic() + timeout_s + 5.0
        while self._settled is None and self._dead is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return Settled(False, f"no answer within {timeout_s:.0f} s")
            self._drain(left)
        if self._settled is None:
            return Settled(False, f"the network process died: {self._dead}")
        return self._settled

    def request_snapshot(self, path: str) -> None:
        """Ask the network process to copy the engine's state and write it to ``path``
        (for a checkpoint); never blocks. The engine is copied before any command sent
        after this one runs. :meth:`snapshot_reply` gives the answer."""
        self._check_usable()
        try:
            _send(self._cmd, ["snapshot", str(path)])
        except OSError:
            self._mark_dead("its command pipe broke")
            self._check_usable()
        self._snapshots[str(path)] = None

    def snapshot_reply(self, path: str) -> SnapshotReply | None:
        """The answer to :meth:`request_snapshot` of ``path`` once it came (handed out
        once), None before; a failed answer when the network process died."""
        if self._closed:
            return SnapshotReply(False, "the bridge is closed", {})
        self._drain(0.0)
        if self._dead is not None and self._snapshots.get(path) is None:
            self._snapshots.pop(path, None)
            return SnapshotReply(False, f"the network process died: {self._dead}", {})
        reply = self._snapshots.get(path)
        if reply is not None:
            del self._snapshots[path]
        return reply

    def snapshot(self, path: str, timeout_s: float) -> SnapshotReply:
        """:meth:`request_snapshot` and wait for its answer, at most ``timeout_s``."""
        try:
            self.request_snapshot(path)
        except NetworkProcessError as e:
            return SnapshotReply(False, str(e), {})
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.snapshot_reply(path)
            if reply is not None:
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                self._snapshots.pop(path, None)
                return SnapshotReply(False, f"no answer within {timeout_s:.1f} s", {})
            self._drain(left)

    def refresh(self, timeout_s: float = 0.0) -> NodeStatus:
        """Read what the network process sent (waiting up to ``timeout_s`` for a first
        message) and return the latest :attr:`status`; outcomes wait for :meth:`poll`."""
        if not self._closed:
            self._drain(timeout_s)
        return self.status

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the network process: ask, wait ``timeout_s``, then kill. Never hangs."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.is_alive():
                with contextlib.suppress(OSError):
                    _send(self._cmd, ["shutdown"])
                self._proc.join(timeout_s)
                if self._proc.is_alive():
                    log.warning("network process did not stop in %.1f s: killing it", timeout_s)
                    self._proc.kill()
                    self._proc.join(2.0)
        finally:
            self._cmd.close()
            self._out.close()
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __enter__(self) -> NetworkBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _take_status(self, msg: list[Any]) -> None:
        """``["status", whole]`` replaces :attr:`status`; ``["info", part]`` updates it.

        A malformed status is a bug of the worker, not a reason to stop training: it is
        logged and the status stays as it was.
        """
        try:
            if len(msg) != 2:
                raise BadStatus(f"{msg[0]} message of {len(msg)} items")
            if msg[0] == "status":
                self.status = NodeStatus.from_wire(msg[1])
            else:
                self.status = self.status.updated(msg[1])
        except BadStatus as e:
            log.warning("dropped a bad status from the network process: %s", e)

    def _check_usable(self) -> None:
        if self._closed:
            raise NetworkProcessError("the bridge is closed")
        if self._dead is None and not self._proc.is_alive():
            self._drain(0.0)
        if self._dead is not None:
            raise NetworkProcessDied(f"the network process died: {self._dead}")

    def _mark_dead(self, detail: str) -> None:
        if self._dead is not None:
            return
        self._proc.join(1.0)
        code = self._proc.exitcode
        self._dead = detail if code is None else f"{detail} (exit code {code})"
        log.error("network process died: %s", self._dead)
        for p, step in self._pending.items():
            self._finished[p] = SyncOutcome(p, step, False, -1, DIED)
            self.stats.failed += 1
        self._pending.clear()

    def _drain(self, timeout_s: float) -> None:
        """Read every message that is there, first waiting up to ``timeout_s`` for one."""
        if self._dead is not None:
            return
        if timeout_s > 0:
            multiprocessing.connection.wait(
                [self._out, self._proc.sentinel, self._wake_r], timeout_s
            )
            with contextlib.suppress(OSError):  # BlockingIOError: nothing to clear
                os.read(self._wake_r, 64)
        try:
            while self._out.poll():
                try:
                    msg = _decode(self._out.recv_bytes(_MAX_MESSAGE))
                except ValueError as e:  # a bug in the worker: say so, keep going
                    log.warning("dropped a malformed message of the network process: %s", e)
                    continue
                self._handle(msg)
        except (EOFError, OSError):
            self._mark_dead("it exited")
            return
        if not self._proc.is_alive():  # everything it sent is read: it is gone
            self._mark_dead("it exited")

    def _handle(self, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == "outcome" and len(msg) == 7:
            o = SyncOutcome(
                int(msg[1]), int(msg[2]), bool(msg[3]), int(msg[4]), str(msg[5]), int(msg[6])
            )
            if self._pending.pop(o.fragment, None) is None:
                log.warning("outcome of fragment %d that has no sync in flight", o.fragment)
                return
            self._finished[o.fragment] = o
            self._holds.pop(o.fragment, None)
            if o.applied:
                self.stats.applied += 1
            else:
                self.stats.failed += 1
        elif kind in ("status", "info"):
            self._take_status(msg)
        elif kind == "hold" and len(msg) == 3:
            p, seconds = int(msg[1]), float(msg[2])
            if p in self._pending and seconds > 0:
                self._holds[p] = time.monotonic() + min(seconds, MAX_HOLD_S)
            else:
                self._holds.pop(p, None)
        elif kind == "settled" and len(msg) == 3:
            self._settled = Settled(bool(msg[1]), str(msg[2]))
        elif kind == "snapshot" and len(msg) == 5:
            path = str(msg[1])
            if path in self._snapshots:
                meta = msg[4] if isinstance(msg[4], dict) else {}
                self._snapshots[path] = SnapshotReply(bool(msg[2]), str(msg[3]), meta)
        elif kind == "error":
            self._mark_dead(f"worker failed: {msg[1] if len(msg) > 1 else '?'}")
        else:
            log.warning("unexpected message from the network process: %r", msg[:1])


# -- the reference worker -------------------------------------------------------------------
async def local_engine_worker(
    shared: SharedFragments,
    inbox: Connection,
    outbox: Connection,
    *,
    config: EngineConfig,
    seed: int = 0,
    delay_s: float = 0.0,
    fail_every: int = 0,
    load_s: float = 0.0,
    load_numel: int = 1 << 20,
    hold_s: float = 0.0,
    release_after_s: float | None = None,
) -> None:
    """An OuterEngine over ``shared`` with a loopback exchange: a group of one.

    The initial global copies are read from ``shared.global_(p)`` at start. A sync encodes
    Δ (:meth:`OuterEngine.begin`), reduces the group's single request
    (:func:`~atoll.protocol.engine.average_requests`), applies the outer step and writes
    the new global copy to ``shared.global_(p)``, all CPU work in worker threads.
    Simulation knobs: ``delay_s`` of network time per round; every ``fail_every``-th
    round fails (``injected fault``); ``load_s`` seconds of CPU load per round (encoding
    a random vector of ``load_numel`` values with the run's codec, again and again);
    ``hold_s`` > 0: each round asks the trainer to wait that long (:func:`post_hold`, as a
    swarm sync that waits for peers due at its slot), and releases it after
    ``release_after_s`` (None: never; the outcome ends the hold).
    Before each outcome it posts its :class:`NodeStatus` (rounds, versions, last syncs).
    """
    engine = OuterEngine(
        config,
        Schedule(config.H, len(shared)),
        [shared.global_(p).copy() for p in range(len(shared))],
        seed=seed,
    )
    lock = trio.Lock()  # one engine call at a time, in start order: deterministic rng use
    seen_tokens = 0
    rounds = 0
    load_rng = np.random.default_rng(seed + 1)
    status = NodeStatus(peer_id="local", versions=tuple(0 for _ in range(len(shared))))

    def begin(sync: FragmentSync, step: int, tokens: int) -> SyncRequest:
        nonlocal seen_tokens
        if tokens > seen_tokens:
            engine.add_tokens(tokens - seen_tokens)
            seen_tokens = tokens
        return sync.begin(shared.local(sync.fragment), step)

    def finish(sync: FragmentSync, request: SyncRequest) -> SyncDone:
        averaged, _ = average_requests([request], engine.codec, config.aggregation)
        done = sync.reduced(ar.Done(averaged))  # a group of one, formed without matchmaking
        assert isinstance(done, SyncDone)
        if done.applied:
            shared.global_(sync.fragment)[:] = engine.global_params(sync.fragment)
        return done

    async def load() -> None:
        x = load_rng.standard_normal(load_numel, dtype=np.float32)
        end = trio.current_time() + load_s
        while trio.current_time() < end:
            await trio.to_thread.run_sync(engine.codec.encode, x, load_rng)

    def report(outcome: SyncOutcome) -> SyncOutcome:
        nonlocal status
        applied = status.rounds_applied + outcome.applied
        status = dataclasses.replace(
            status,
            rounds_applied=applied,
            rounds_failed=status.rounds_failed + (not outcome.applied),
            versions=tuple(engine.version(q) for q in range(len(shared))),
            last_sync={**status.last_sync, outcome.fragment: outcome.reason or "applied"},
        )
        post_status(outbox, status)
        return outcome

    async def run_round(p: int, step: int, tokens: int) -> SyncOutcome:
        nonlocal rounds
        sync = FragmentSync(engine, p, peer_id="local", run_id="local")
        async with lock:
            request = await trio.to_thread.run_sync(begin, sync, step, tokens)
        rounds += 1
        try:
            if hold_s > 0:
                post_hold(outbox, p, hold_s)
                if release_after_s is not None:
                    await trio.sleep(release_after_s)
                    post_hold(outbox, p, 0.0)
            if delay_s > 0:
                await trio.sleep(delay_s)
            if load_s > 0:
                await load()
            if fail_every and rounds % fail_every == 0:
                sync.reduced(ar.Failed("injected fault"))
                return SyncOutcome(p, step, False, request.round, "injected fault")
            async with lock:
                done = await trio.to_thread.run_sync(finish, sync, request)
        except BaseException as e:
            reason = "cancelled" if isinstance(e, trio.Cancelled) else f"{type(e).__name__}: {e}"
            sync.abort(reason)
            if isinstance(e, AtollError):
                return SyncOutcome(p, step, False, request.round, f"{type(e).__name__}: {e}")
            raise
        return SyncOutcome(p, step, done.applied, request.round, done.reason)

    async def handle(p: int, step: int, tokens: int) -> SyncOutcome:
        return report(await run_round(p, step, tokens))

    async def snapshot(path: str) -> Callable[[], dict[str, Any]]:
        from atoll.node.snapshot import write_engine_file

        async with lock:
            state = engine.state_dict()
        return functools.partial(write_engine_file, path, state)

    await serve(inbox, outbox, handle, snapshot=snapshot)


def post_hold(outbox: Connection, fragment: int, seconds: float) -> None:
    """Tell the trainer that fragment's sync waits ``seconds`` more for peers due at its
    slot (0: no longer); see :meth:`NetworkBridge.wait`."""
    with contextlib.suppress(OSError):  # the trainer went away: serve() notices
        _send(outbox, ["hold", int(fragment), float(seconds)])


def post_status(outbox: Connection, status: NodeStatus) -> None:
    """Send the whole ``status`` to the trainer (it becomes :attr:`NetworkBridge.status`).

    The network process keeps its current status and sends a new one
    (:func:`dataclasses.replace` for a partial change).
    """
    with contextlib.suppress(OSError):  # the trainer went away: serve() notices
        _send(outbox, ["status", status.to_wire()])
