"""A network-namespace fault lab that a program builds for itself and removes again.

:class:`NetLab` gives each of N nodes its own Linux network namespace and address on a
private bridge, and the faults a swarm must survive: a silent cut of one node, a
partition into groups, a rate limit per direction. Tests and benchmarks run real
processes inside it (:meth:`NetLab.prefix`)::

    with NetLab(3) as lab:
        subprocess.run([*lab.prefix(0), sys.executable, "-c", "..."])  # inside node 0
        lab.cut(1)                        # node 1 drops every packet, silently
        lab.heal(1)
        lab.partition([[0], [1, 2]])      # 0 cannot reach 1 or 2; 1 and 2 still talk
        lab.heal_all()
        lab.shape(2, rate_up="1mbit", rate_down="50mbit")

Topology: the bridge lives in a namespace of its own (the lab's *switch*), so nothing of
the host's network changes (no interface, address, route or firewall rule is added to the
namespace the program runs in)::

    node i: [eth0 10.231.x.(i+1)/24] ==veth== [v<i>] br0   (switch namespace, no address)

Every node has its loopback up, no default route and no IPv6 on ``eth0``; the /24 is
chosen among ``10.231.0.0/16`` so that it overlaps no address or route of the host.
Namespaces are named ``atl<pid>-<k>n<i>`` (switch: ``atl<pid>-<k>sw``), with the pid of
the program and a counter, so that parallel runs and several labs in one program never
collide.

Faults:

- :meth:`NetLab.cut`: iptables DROP of every packet in and out of the node's namespace
  except on its loopback. Peers see silence: no RST, no ICMP, their connects and writes
  time out. (A datagram the cut node itself sends fails with EPERM locally; its TCP
  connects and writes just time out.)
- :meth:`NetLab.partition`: iptables DROP, in each node's namespace, of the addresses of
  the nodes in other groups; nodes of one group still talk, a node in no group talks to
  everyone. The rules of a namespace are replaced atomically (``iptables-restore``).
- :meth:`NetLab.shape`: a token bucket (tbf) on the node's side of its veth (upload) and
  on the switch's side (download), with about 100 ms of queue. Rate only: a fixed delay
  needs netem, which kernels built without it (like the development VM's) lack.

Clean-up: :meth:`NetLab.close` ends the processes still inside the lab's namespaces
(SIGTERM, then SIGKILL), then deletes the namespaces, which removes the veths and the
bridge with them. It runs when the ``with`` block ends (also on an exception), at
interpreter exit (atexit), and on SIGTERM or SIGHUP, which the lab turns into
``SystemExit`` while a lab is open (only when the program left those signals at their
default). A lab left behind by a killed program (SIGKILL) is removed by the next lab
built on the machine: namespaces of this naming whose program is gone and that hold no
process.

:func:`available` says in one line why a lab cannot be built here (not root, a missing
tool, namespaces not permitted), or None.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from types import FrameType, TracebackType
from typing import Any

from atoll.protocol.errors import AtollError

__all__ = ["LabError", "NetLab", "available", "list_namespaces", "ns_pids", "parse_rate"]

logger = logging.getLogger(__name__)

TOOLS = ("ip", "tc", "iptables-restore")
"""the programs a lab runs (packages iproute2 and iptables on Debian)"""
COMMAND_TIMEOUT_S = 10.0
"""bound of every command the lab runs"""
STOP_TIMEOUT_S = 5.0
"""how long processes left in a namespace get after SIGTERM, and after SIGKILL"""
BASE_NET = ipaddress.IPv4Network("10.231.0.0/16")
"""the lab's /24 is one of this /16"""
QUEUE_S = 0.1
"""bottleneck buffer of a shaped link, as time at its rate"""
MAX_NODES = 250

_NAME = re.compile(r"^atl(\d+)-(\d+)(?:n\d+|sw)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)?$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_counter = itertools.count()


class LabError(AtollError):
    """A lab could not be built, changed or removed; the message names the command."""


def parse_rate(rate: str | int) -> int:
    """Bits per second of ``rate``: an int, or a string like ``50mbit``, ``1.5Mbit``,
    ``800kbit`` (units bit, kbit, mbit, gbit; powers of 1000). LabError when malformed."""
    if isinstance(rate, int):
        bits = rate
    else:
        m = _RATE.match(rate.strip())
        if m is None:
            raise LabError(f"bad rate {rate!r}: use a number of bits/s or e.g. '50mbit'")
        bits = round(float(m.group(1)) * _UNITS[(m.group(2) or "bit").lower()])
    if bits <= 0:
        raise LabError(f"bad rate {rate!r}: must be positive")
    return bits


def _argv(*parts: str) -> list[str]:
    """A command line from words and space-separated phrases (no word holds a space)."""
    return [word for part in parts for word in part.split()]


def _run(
    args: Sequence[str],
    what: str,
    *,
    stdin: str | None = None,
    timeout_s: float = COMMAND_TIMEOUT_S,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``args``; LabError saying ``what`` failed (the command and its error) when it
    cannot start, runs past ``timeout_s`` or (``check``) exits non-zero."""
    cmd = " ".join(args)
    logger.debug("netlab: %s", cmd)
    try:
        done = subprocess.run(
            list(args), input=stdin, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise LabError(f"{what}: `{cmd}` did not finish in {timeout_s:.0f} s") from None
    except OSError as e:
        raise LabError(f"{what}: `{cmd}` could not start: {e}") from None
    if check and done.returncode != 0:
        err = (done.stderr.strip() or done.stdout.strip() or "no message").splitlines()[-1]
        raise LabError(f"{what}: `{cmd}` failed (exit {done.returncode}): {err}")
    return done


def list_namespaces() -> list[str]:
    """The names of the network namespaces on this machine."""
    out = _run(["ip", "netns", "list"], "listing network namespaces").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ns_pids(name: str) -> list[int]:
    """The processes running in namespace ``name``."""
    done = _run(["ip", "netns", "pids", name], f"listing processes in {name}", check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_processes(names: Iterable[str]) -> list[int]:
    """SIGTERM the processes in namespaces ``names``, SIGKILL those left after
    :data:`STOP_TIMEOUT_S`; the pids still alive after that (normally none)."""
    names = list(names)

    def pids() -> list[int]:
        return [p for n in names for p in ns_pids(n) if p != os.getpid()]

    left = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not left:
            return []
        logger.info("netlab: sending %s to %d processes left in the lab", sig.name, len(left))
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (left := pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
    return left


def _delete_namespaces(names: Iterable[str]) -> list[str]:
    """Delete the namespaces ``names`` that exist; the errors, one line each."""
    errors = []
    existing = set(list_namespaces())
    for name in names:
        if name not in existing:
            continue
        try:
            _run(["ip", "netns", "del", name], f"deleting namespace {name}")
        except LabError as e:
            errors.append(str(e))
    return errors


def sweep_stale() -> list[str]:
    """Remove namespaces of labs whose program is gone and that hold no process (a
    program killed with SIGKILL cannot clean up); the names removed."""
    stale = []
    for name in list_namespaces():
        m = _NAME.match(name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        if not ns_pids(name):
            stale.append(name)
    # node namespaces first: the switch goes last, like close() does
    stale.sort(key=lambda n: n.endswith("sw"))
    errors = _delete_namespaces(stale)
    if stale:
        logger.info("netlab: removed %d namespaces of labs left behind", len(stale))
    for e in errors:
        logger.warning("netlab: %s", e)
    return stale


def _missing_tool() -> str | None:
    for tool in TOOLS:
        if shutil.which(tool) is None:
            package = "iptables" if tool.startswith("iptables") else "iproute2"
            return (
                f"no `{tool}` on PATH (Debian package {package}; `make netlab-deps` "
                "installs it as root)"
            )
    return None


def available() -> str | None:
    """None when a lab can be built on this machine; else one line saying why not (not
    Linux, not root, a missing tool, network namespaces or a feature not permitted).

    Builds and removes a probe namespace with a bridge, a veth, a firewall table and a
    token bucket, so the answer holds for :class:`NetLab`.
    """
    if not sys.platform.startswith("linux"):
        return f"the network lab needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"the network lab needs root to create network namespaces (uid {os.geteuid()})"
    missing = _missing_tool()
    if missing is not None:
        return f"the network lab cannot run: {missing}"
    name = f"atl{os.getpid()}-{next(_counter)}sw"
    steps = [
        (["ip", "netns", "add", name], None, "create a network namespace"),
        (["ip", "-n", name, "link", "add", "br0", "type", "bridge"], None, "create a bridge"),
        (
            ["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
            None,
            "create a veth pair",
        ),
        (
            ["ip", "netns", "exec", name, "iptables-restore"],
            _rules(False, ()),
            "load iptables rules in a namespace",
        ),
        (
            _argv("tc -n", name, "qdisc add dev p0 root tbf rate 1mbit burst 10000 limit 100000"),
            None,
            "add a tbf qdisc",
        ),
    ]
    try:
        for args, stdin, what in steps:
            try:
                _run(args, what, stdin=stdin)
            except LabError as e:
                return f"the network lab cannot run here: cannot {what} ({e})"
        return None
    finally:
        with contextlib.suppress(LabError):
            _delete_namespaces([name])


def _rules(cut: bool, blocked: Iterable[str]) -> str:
    """The filter table of a node's namespace (iptables-restore input): loopback always
    passes; ``cut`` drops everything else, ``blocked`` addresses are dropped both ways."""
    lines = [
        "*filter",
        ":INPUT ACCEPT [0:0]",
        ":FORWARD ACCEPT [0:0]",
        ":OUTPUT ACCEPT [0:0]",
        "-A INPUT -i lo -j ACCEPT",
        "-A OUTPUT -o lo -j ACCEPT",
    ]
    if cut:
        lines += ["-A INPUT -j DROP", "-A OUTPUT -j DROP"]
    for addr in sorted(blocked):
        lines += [f"-A INPUT -s {addr}/32 -j DROP", f"-A OUTPUT -d {addr}/32 -j DROP"]
    return "\n".join([*lines, "COMMIT", ""])


def _host_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this namespace's addresses and routes."""
    nets = []
    for args in (["ip", "-o", "-4", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        out = _run(args, "reading the host's addresses").stdout
        for token in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\b", out):
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(token, strict=False))
    return nets


def _pick_subnet(seed: int) -> ipaddress.IPv4Network:
    taken = _host_networks()
    subnets = list(BASE_NET.subnets(new_prefix=24))[1:-1]
    start = seed % len(subnets)
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise LabError(f"every /24 of {BASE_NET} overlaps an address or route of this machine")


class _SignalGuard:
    """While labs are open: SIGTERM and SIGHUP (when at their default) raise SystemExit in
    the main thread, so ``with`` blocks unwind and atexit handlers (the labs' close) run."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.users = 0
        self.saved: dict[int, Any] = {}
        self.lock = threading.Lock()

    @staticmethod
    def _raise(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def acquire(self) -> None:
        with self.lock:
            self.users += 1
            if self.users > 1 or threading.current_thread() is not threading.main_thread():
                return
            for s in self.SIGNALS:
                if signal.getsignal(s) is signal.SIG_DFL:
                    self.saved[s] = signal.signal(s, self._raise)

    def release(self) -> None:
        with self.lock:
            self.users = max(0, self.users - 1)
            if self.users or threading.current_thread() is not threading.main_thread():
                return
            for s, old in self.saved.items():
                if signal.getsignal(s) is self._raise:
                    signal.signal(s, old)
            self.saved.clear()


_guard = _SignalGuard()


class NetLab:
    """``n`` network namespaces on a private bridge, with faults (see the module docstring).

    Built when constructed; :meth:`close` (or the end of a ``with`` block) removes it.
    LabError when a step fails (what was built is removed first).
    """

    def __init__(self, n: int, *, handle_signals: bool = True) -> None:
        if not 1 <= n <= MAX_NODES:
            raise LabError(f"a lab has 1 to {MAX_NODES} nodes, not {n}")
        missing = _missing_tool()
        if missing is not None:
            raise LabError(missing)
        self.n = n
        tag = f"atl{os.getpid()}-{next(_counter)}"
        self.switch = f"{tag}sw"
        self.names: tuple[str, ...] = tuple(f"{tag}n{i}" for i in range(n))
        self._cut: set[int] = set()
        self._blocked: dict[int, set[int]] = {}
        self._made: list[str] = []
        self._closed = False
        self._close_lock = threading.Lock()
        self._signals = handle_signals
        if handle_signals:
            _guard.acquire()
        atexit.register(self._close_at_exit)
        try:
            sweep_stale()
            self.network = _pick_subnet(os.getpid() + int(tag.rsplit("-", 1)[1]))
            self._build()
        except BaseException:
            self._close_at_exit()
            raise
        logger.info(
            "netlab: %d namespaces %s..%s on %s (switch %s)",
            n,
            self.names[0],
            self.names[-1],
            self.network,
            self.switch,
        )

    # -- building ----------------------------------------------------------------------------
    def _build(self) -> None:
        sw = self.switch
        self._made.append(sw)
        _run(["ip", "netns", "add", sw], "creating the switch namespace")
        self._sysctl(sw, "net/ipv6/conf/all/disable_ipv6", "1")
        _run(
            _argv("ip -n", sw, "link add br0 type bridge stp_state 0 forward_delay 0"),
            "creating the bridge",
        )
        _run(["ip", "-n", sw, "link", "set", "br0", "up"], "bringing the bridge up")
        for i, name in enumerate(self.names):
            self._made.append(name)
            _run(["ip", "netns", "add", name], f"creating namespace {name}")
            _run(
                _argv("ip -n", sw, f"link add v{i} type veth peer name eth0 netns", name),
                f"creating node {i}'s veth",
            )
            _run(
                ["ip", "-n", sw, "link", "set", f"v{i}", "master", "br0", "up"],
                f"attaching node {i}'s veth to the bridge",
            )
            _run(["ip", "-n", name, "link", "set", "lo", "up"], f"node {i}'s loopback")
            self._sysctl(name, "net/ipv6/conf/eth0/disable_ipv6", "1")
            _run(
                _argv("ip -n", name, f"addr add {self.ip(i)}/{self.network.prefixlen} dev eth0"),
                f"node {i}'s address",
            )
            _run(["ip", "-n", name, "link", "set", "eth0", "up"], f"node {i}'s eth0")
            self._apply_rules(i)

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        _run(
            ["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > /proc/sys/{key}"],
            f"setting {key} in {ns}",
        )

    def add_namespace(self, index: int, what: str) -> str:
        """Create one more namespace of this lab (its loopback up, IPv6 off), named like
        its nodes with ``index`` (which must be past theirs), and removed with them; its
        name. For labs built on this one (:mod:`~atoll.node.natlab`)."""
        self._check(0)
        if index < self.n:
            raise LabError(f"namespace index {index} is a node's (0..{self.n - 1})")
        name = f"{self.switch[: -len('sw')]}n{index}"
        self._made.insert(0, name)  # removed before the switch, like the nodes
        _run(["ip", "netns", "add", name], f"creating {what}")
        _run(["ip", "-n", name, "link", "set", "lo", "up"], f"{what}'s loopback")
        self._sysctl(name, "net/ipv6/conf/all/disable_ipv6", "1")
        return name

    def command(
        self, args: Sequence[str], what: str, *, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run one lab command (``ip``, ``iptables-restore`` ...) bounded by
        :data:`COMMAND_TIMEOUT_S`; LabError saying ``what`` failed."""
        self._check(0)
        return _run(args, what, stdin=stdin)

    def sysctl(self, ns: str, key: str, value: str) -> None:
        """Set ``/proc/sys/<key>`` in namespace ``ns`` of this lab."""
        self._check(0)
        self._sysctl(ns, key, value)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace of the lab: the nodes', added ones and the switch."""
        return tuple(self._made)

    # -- addresses ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"NetLab({self.n} nodes on {self.network}, namespaces {self.names[0]}..)"

    def _check(self, i: int) -> None:
        if self._closed:
            raise LabError("the lab is closed")
        if not 0 <= i < self.n:
            raise LabError(f"no node {i} in a lab of {self.n} (0..{self.n - 1})")

    def ip(self, i: int) -> str:
        """Node ``i``'s IPv4 address."""
        if not 0 <= i < self.n:
            raise LabError(f"no node {i} in a lab of {self.n} (0..{self.n - 1})")
        return str(self.network.network_address + i + 1)

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside node ``i``'s namespace (same
        files, environment and user; only the network differs)."""
        self._check(i)
        return ["ip", "netns", "exec", self.names[i]]

    def pids(self, i: int) -> list[int]:
        """The processes now running inside node ``i``'s namespace."""
        self._check(i)
        return ns_pids(self.names[i])

    # -- faults ------------------------------------------------------------------------------
    def _apply_rules(self, i: int) -> None:
        blocked = [self.ip(j) for j in self._blocked.get(i, ())]
        _run(
            ["ip", "netns", "exec", self.names[i], "iptables-restore"],
            f"loading node {i}'s firewall rules",
            stdin=_rules(i in self._cut, blocked),
        )

    def cut(self, i: int) -> None:
        """Blackhole node ``i`` silently: every packet in or out of it is dropped (its
        loopback still works); peers get no RST and no ICMP, only timeouts."""
        self._check(i)
        self._cut.add(i)
        self._apply_rules(i)
        logger.info("netlab: node %d cut", i)

    def heal(self, i: int) -> None:
        """Undo :meth:`cut` of node ``i`` (a partition stays as it is)."""
        self._check(i)
        self._cut.discard(i)
        self._apply_rules(i)
        logger.info("netlab: node %d healed", i)

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        """Split the nodes into ``groups`` that cannot exchange packets (silently);
        within a group they can, and a node in no group reaches everyone. Replaces the
        previous partition; cuts stay as they are."""
        seen: set[int] = set()
        for group in groups:
            for i in group:
                self._check(i)
                if i in seen:
                    raise LabError(f"node {i} is in two groups of the partition {groups}")
                seen.add(i)
        blocked: dict[int, set[int]] = {}
        for a, b in itertools.combinations(range(len(groups)), 2):
            for i in groups[a]:
                for j in groups[b]:
                    blocked.setdefault(i, set()).add(j)
                    blocked.setdefault(j, set()).add(i)
        changed = set(blocked) | set(self._blocked)
        self._blocked = blocked
        for i in sorted(changed):
            self._apply_rules(i)
        logger.info("netlab: partition %s", " | ".join(",".join(map(str, g)) for g in groups))

    def heal_all(self) -> None:
        """Undo every cut and the partition (link shapes stay)."""
        if self._closed:
            raise LabError("the lab is closed")
        changed = self._cut | set(self._blocked)
        self._cut.clear()
        self._blocked.clear()
        for i in sorted(changed):
            self._apply_rules(i)
        logger.info("netlab: every node healed")

    def shape(
        self, i: int, rate_up: str | int | None = None, rate_down: str | int | None = None
    ) -> None:
        """Limit node ``i``'s upload and download rate (:func:`parse_rate`; None: no
        limit), with a tbf token bucket on each end of its veth and about
        :data:`QUEUE_S` of queue. Rate only: a fixed delay would need netem, which this
        lab does not use (kernels built without it are common on VMs)."""
        self._check(i)
        self._tbf(self.names[i], "eth0", rate_up, f"node {i}'s upload")
        self._tbf(self.switch, f"v{i}", rate_down, f"node {i}'s download")
        logger.info("netlab: node %d shaped: up %s, down %s", i, rate_up, rate_down)

    def _tbf(self, ns: str, dev: str, rate: str | int | None, what: str) -> None:
        if rate is None:
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], what, check=False)
            return
        bits = parse_rate(rate)
        per_s = bits // 8
        burst = max(per_s // 500, 4 * 1514)  # 2 ms of rate, at least 4 full frames
        limit = int(per_s * QUEUE_S) + burst
        _run(
            _argv("tc -n", ns, f"qdisc replace dev {dev} root tbf rate {bits}bit")
            + _argv(f"burst {burst} limit {limit}"),
            what,
        )

    # -- clean-up ----------------------------------------------------------------------------
    def close(self) -> None:
        """End the processes left in the lab, then delete its namespaces (the veths and
        the bridge go with them). Idempotent; LabError when something was left behind."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self._close_at_exit)
            try:
                # the nodes first, the switch last (its bridge holds the veths' other ends)
                order = [n for n in self._made if n != self.switch]
                order += [n for n in self._made if n == self.switch]
                left = _end_processes(order)
                errors = _delete_namespaces(order)
                if left:
                    errors.append(f"processes {left} did not end")
                leftover = sorted(set(self._made) & set(list_namespaces()))
                if leftover:
                    errors.append(f"namespaces {leftover} still exist")
            finally:
                if self._signals:
                    _guard.release()
        if errors:
            raise LabError("the lab was not removed cleanly: " + "; ".join(errors))
        logger.info("netlab: removed %s", self.switch[: -len("sw")] + "*")

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except LabError as e:
            logger.warning("netlab: %s", e)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self._close_at_exit()  # the block's own error is the one to see
