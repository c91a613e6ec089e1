"""py-libp2p's internals as atoll relies on them: fail loudly, naming the internal and the
atoll code that needs it, when the installed py-libp2p moved or reshaped one.

Every internal atoll touches is registered in ``INTERNALS`` of
:mod:`atoll.node.net.libp2p_internals` (the host, and the transport's subclasses) or
:mod:`atoll.dht.libp2p_internals` (the Kademlia adapter). These tests

- walk both lists against the installed py-libp2p: each path exists, is of its kind, and
  has the registered parameter names where the signature matters;
- run the accessors on real, unstarted libp2p objects (no sockets), so an internal read
  through ``getattr(..., default)`` cannot quietly turn into a no-op;
- keep the rule: the internals modules touch nothing unregistered, ``host.py`` and
  ``kad.py`` touch no internal themselves, and the transport's subclasses override only
  registered methods and shadow no name of their libp2p bases.

Upgrading the py-libp2p pin starts here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import textwrap
import types
from functools import cache
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.basic_host import BasicHost
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.peerinfo import PeerInfo
from libp2p.stream_muxer.yamux.yamux import Yamux

from atoll.dht import libp2p_internals as dht_internals
from atoll.node.net import libp2p_internals as node_internals
from atoll.node.net import transport

ROOT = Path(__file__).resolve().parents[2]
LIBP2P = importlib.metadata.version("libp2p")
REGISTRIES = {
    "atoll.node.net.libp2p_internals": node_internals.INTERNALS,
    "atoll.dht.libp2p_internals": dht_internals.INTERNALS,
}
ENTRIES = [(owner, entry) for owner, entries in REGISTRIES.items() for entry in entries]
KINDS = {
    "module",
    "class",
    "function",
    "method",
    "async method",
    "property",
    "instance attribute",
    "int constant",
    "str constant",
}


# -- the shape of one internal ------------------------------------------------------------------
@cache
def _assigned_in(klass: type) -> frozenset[str]:
    """Names one class (not its bases) assigns as ``self.<name>`` in any of its methods or
    declares in its body, read from its source; empty for a class without Python source."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return frozenset()
    body = ast.parse(source).body[0]
    if not isinstance(body, ast.ClassDef):
        return frozenset()
    names = {
        node.target.id
        for node in body.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    for node in ast.walk(body):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
            elif (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return frozenset(names)


def _instance_attributes(cls: type) -> frozenset[str]:
    """The instance attributes a class or one of its bases sets (see :func:`_assigned_in`)."""
    return frozenset().union(*(_assigned_in(k) for k in cls.__mro__ if k is not object))


def _shape_problem(path: str, kind: str, params: tuple[str, ...] | None) -> str | None:
    """What is wrong with the internal at ``path`` in the installed py-libp2p, or None."""
    if kind not in KINDS:
        return f"unknown kind {kind!r} in the registry (one of {sorted(KINDS)})"
    module_name, _, qualname = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return f"module {module_name} cannot be imported: {e}"
    if kind == "module":
        return None if not qualname else "a module entry names no attribute"
    *parents, name = qualname.split(".")
    owner: Any = module
    for part in parents:
        if not hasattr(owner, part):
            return f"{owner.__name__} has no {part!r}"
        owner = getattr(owner, part)
    if kind == "instance attribute":
        if not isinstance(owner, type):
            return f"{'.'.join(parents)} is no longer a class"
        if name not in _instance_attributes(owner):
            return f"{owner.__qualname__} (and its bases) no longer set self.{name}"
        return None
    try:
        static = inspect.getattr_static(owner, name)
    except AttributeError:
        return f"{getattr(owner, '__qualname__', owner.__name__)} has no {name!r}"
    value = getattr(owner, name)
    found = {
        "class": isinstance(value, type),
        "function": inspect.isfunction(value) and not inspect.iscoroutinefunction(value),
        "method": isinstance(static, types.FunctionType)
        and not inspect.iscoroutinefunction(static),
        "async method": isinstance(static, types.FunctionType)
        and inspect.iscoroutinefunction(static),
        "property": isinstance(static, property),
        "int constant": isinstance(value, int) and not isinstance(value, bool),
        "str constant": isinstance(value, str),
    }[kind]
    if not found:
        return f"is now {type(static).__name__} {value!r:.80}, not a {kind}"
    if params is not None:
        got = tuple(inspect.signature(value).parameters)
        if got != params:
            return f"parameters are now {got}, atoll calls it with {params}"
    return None


@pytest.mark.parametrize(
    ("owner", "entry"),
    ENTRIES,
    ids=[f"{owner.split('.')[1]}:{entry.path.split(':')[-1]}" for owner, entry in ENTRIES],
)
def test_internal_keeps_its_shape(owner: str, entry: Any) -> None:
    problem = _shape_problem(entry.path, entry.kind, entry.params)
    assert problem is None, (
        f"py-libp2p {LIBP2P}: the internal {entry.path} ({entry.kind}) that "
        f"{owner} registers for {entry.used_by or 'atoll'} changed: {problem}. "
        f"Adapt {owner} (and its INTERNALS entry) to the new py-libp2p before upgrading."
    )


def test_the_shape_check_catches_a_change() -> None:
    """The walk above is not vacuous: moved, retyped and resigned internals are caught."""
    swarm = "libp2p.network.swarm"
    assert _shape_problem(f"{swarm}:Swarm._no_such_cache", "instance attribute", None)
    assert _shape_problem(f"{swarm}:Swarm.remove_conn", "async method", None)
    assert _shape_problem(f"{swarm}:Swarm.remove_conn", "method", ("self", "conn"))
    assert _shape_problem("libp2p.no_such_module", "module", None)
    assert _shape_problem(f"{swarm}:NoSuchClass.method", "method", None)
    assert _shape_problem(f"{swarm}:Swarm.remove_conn", "method", ("self", "swarm_conn")) is None


def test_registries_are_well_formed() -> None:
    for owner, entries in REGISTRIES.items():
        paths = [e.path for e in entries]
        assert len(paths) == len(set(paths)), f"{owner}: an internal is registered twice"
        for e in entries:
            assert e.kind in KINDS, f"{owner}: {e.path} has an unknown kind {e.kind!r}"
            assert e.used_by, f"{owner}: {e.path} does not say which atoll code needs it"


# -- the accessors on real libp2p objects -------------------------------------------------------
@pytest.fixture
def host() -> BasicHost:
    """An unstarted py-libp2p host with its swarm (no socket is opened)."""
    made = new_host(key_pair=create_new_key_pair())
    assert isinstance(made, BasicHost)
    return made


def _other_peer() -> Any:
    return new_host(key_pair=create_new_key_pair()).get_id()


def test_node_accessors_reach_a_real_swarm_and_muxer(host: BasicHost) -> None:
    network = host.get_network()
    # what the getattr-with-default accessors read is there, so none of them is a no-op
    assert getattr(network, "_negative_peer_cache", None) is not None
    assert getattr(network, "auto_connector", None) is not None
    peer = _other_peer()
    network._negative_peer_cache.mark_failed(str(peer))  # type: ignore[attr-defined]
    assert network._negative_peer_cache.is_blocked(str(peer))  # type: ignore[attr-defined]
    node_internals.clear_dial_backoff(host, str(peer))
    assert not network._negative_peer_cache.is_blocked(str(peer))  # type: ignore[attr-defined]
    trio.run(node_internals.stop_auto_connector, host)
    # a connection the table does not hold: removing it is a quiet no-op
    node_internals.forget_connection(
        network, types.SimpleNamespace(muxed_conn=types.SimpleNamespace(peer_id=peer))
    )  # type: ignore[arg-type]

    yamux = Yamux(types.SimpleNamespace(is_initiator=True), peer)  # type: ignore[arg-type]
    assert not node_internals.muxer_shutting_down(yamux)
    yamux.event_shutting_down.set()
    assert node_internals.muxer_shutting_down(yamux)

    wildcard = multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4001")
    expanded = node_internals.expand_wildcard_address(wildcard)
    assert expanded and all(isinstance(a, multiaddr.Multiaddr) for a in expanded)


def test_dht_accessors_reach_a_real_kad_dht(host: BasicHost) -> None:
    kad = KadDHT(host, DHTMode.SERVER)
    # KadDHT spells LIBRARY_PROTOCOL for its streams: the host proxy renames exactly that
    assert dht_internals.LIBRARY_PROTOCOL in host.get_mux().handlers
    assert dht_internals.value_store_of(kad) is kad.value_store

    key = b"/atoll/v1/test/key"
    assert dht_internals.local_value(kad, key) is None
    dht_internals.keep_local_value(kad, key, b"value")
    assert dht_internals.local_value(kad, key) == b"value"
    assert key not in kad.value_store.local_keys  # kept, never republished

    provider = PeerInfo(_other_peer(), [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")])
    assert dht_internals.local_providers(kad, key) == []
    dht_internals.add_local_provider(kad, key, provider)
    assert [p.peer_id for p in dht_internals.local_providers(kad, key)] == [provider.peer_id]

    assert dht_internals.routing_table_size(kad) == 0
    assert not dht_internals.in_routing_table(kad, provider.peer_id)
    assert trio.run(dht_internals.admit_to_routing_table, kad, provider)
    assert dht_internals.in_routing_table(kad, provider.peer_id)
    assert dht_internals.routing_table_peer_ids(kad) == [provider.peer_id]
    assert dht_internals.routing_table_size(kad) == 1
    target = b"\x12\x20" + bytes(32)  # a lookup target: a sha2-256 multihash
    assert dht_internals.routing_table_closest(kad, target, 20) == [provider.peer_id]
    assert dht_internals.routing_table_closest(kad, target, 0) == []


# -- the rule: reach-ins only through the internals modules -------------------------------------
INTERNALS_FILES = {
    "atoll.node.net.libp2p_internals": ROOT / "node/net/libp2p_internals.py",
    "atoll.dht.libp2p_internals": ROOT / "dht/libp2p_internals.py",
}
USERS = {
    "atoll.node.net.libp2p_internals": ROOT / "node/net/host.py",
    "atoll.dht.libp2p_internals": ROOT / "dht/kad.py",
}
PUBLIC_IMPORTS = {
    "libp2p.abc",
    "libp2p.custom_types",
    "libp2p.peer.id",
    "libp2p.peer.peerinfo",
    "libp2p.kad_dht.kad_dht",
}
"""py-libp2p modules the internals modules may import from without registering the name."""
PUBLIC_ATTRIBUTES = {"get_network", "is_set", "Event", "Multiaddr", "value", "discard"}
"""Attributes the internals modules read on documented objects (the host's network, a trio
Event, a multiaddr, a protobuf record's value, a set) without registering them."""
OWN_PRIVATE = {"atoll._on_stream", "dht._admit_soon"}
"""Private names of atoll's own objects that host.py and kad.py use across objects."""
GENERIC = {"__init__", "conn", "read", "write", "get", "put", "size", "stop", "evict"}
"""Registered names too common to grep for in host.py and kad.py (streams read and write,
dicts get): their libp2p owners are reached only through the internals modules, which the
other checks cover."""


def _registered_names(entries: Any) -> set[str]:
    return {e.path.partition(":")[2].split(".")[-1] for e in entries if ":" in e.path}


def _registered_modules(entries: Any) -> set[str]:
    return {e.path for e in entries if e.kind == "module"}


def _literal_attribute_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every getattr/hasattr/setattr with a literal attribute name."""
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr", "setattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            out.append((node.lineno, node.args[1].value))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@pytest.mark.parametrize("owner", list(INTERNALS_FILES))
def test_internals_modules_register_every_reach_in(owner: str) -> None:
    """Whatever an internals module reads of libp2p is registered in its INTERNALS (or is
    one of the few public names above): a new reach-in cannot slip in unlisted."""
    entries = REGISTRIES[owner]
    names = _registered_names(entries)
    modules = _registered_modules(entries)
    path = INTERNALS_FILES[owner]
    tree = ast.parse(path.read_text(), str(path))
    unlisted = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("libp2p"):
            module = node.module or ""
            for alias in node.names:
                if module in PUBLIC_IMPORTS or module in modules:
                    continue
                if f"{module}:{alias.name}" not in {e.path for e in entries}:
                    unlisted.append(f"line {node.lineno}: from {module} import {alias.name}")
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Attribute)
                and node.attr not in names
                and node.attr not in PUBLIC_ATTRIBUTES
            ):
                unlisted.append(f"line {node.lineno}: .{node.attr}")
        for line, name in _literal_attribute_calls(fn):
            if name not in names:
                unlisted.append(f"line {line}: getattr/hasattr {name!r}")
    assert not unlisted, (
        f"{path.relative_to(ROOT)} reaches into py-libp2p without registering it in "
        f"INTERNALS (add an Internal entry, or the name to PUBLIC_* here if it is "
        f"documented API):\n" + "\n".join(unlisted)
    )


@pytest.mark.parametrize("owner", list(USERS))
def test_host_and_kad_touch_no_internal_themselves(owner: str) -> None:
    """host.py and kad.py reach py-libp2p internals only through their internals module:
    no private attribute of another object, no getattr of a private or registered name,
    no registered attribute, no import of a registered module or name, and (kad.py) no
    part of the KadDHT itself."""
    entries = REGISTRIES[owner]
    forbidden = _registered_names(entries) - GENERIC
    modules = _registered_modules(entries)
    paths = {e.path for e in entries}
    path = USERS[owner]
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            text = f"{base}.{node.attr}"
            if base == "libp2p_internals":  # the way through
                continue
            if _private(node.attr) and base not in {"self", "cls"} and text not in OWN_PRIVATE:
                found.append(f"line {node.lineno}: {text}")
            elif node.attr in forbidden and base not in {"self", "cls"}:
                found.append(f"line {node.lineno}: {text} (a registered internal)")
            elif base == "self._kad":
                found.append(f"line {node.lineno}: {text} (KadDHT's parts are internals)")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module in modules or f"{node.module}:{alias.name}" in paths:
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            found.extend(
                f"line {node.lineno}: import {a.name}" for a in node.names if a.name in modules
            )
    for line, name in _literal_attribute_calls(tree):
        if _private(name) or name in forbidden:
            found.append(f"line {line}: getattr/hasattr {name!r}")
    assert not found, (
        f"{path.relative_to(ROOT)} touches py-libp2p internals itself; go through "
        f"{owner} (add an accessor there and register what it touches):\n" + "\n".join(found)
    )


LEAN_CLASSES = (transport.LeanNoiseTransport, transport.LeanNoiseSession, transport.LeanYamux)


def _libp2p_bases(cls: type) -> list[type]:
    return [b for b in cls.__mro__[1:] if b.__module__.startswith("libp2p.")]


@pytest.mark.parametrize("cls", LEAN_CLASSES, ids=lambda c: c.__name__)
def test_transport_overrides_only_registered_methods(cls: type) -> None:
    """transport.py's subclasses of py-libp2p classes: every method they override is
    registered (with its signature), and no name of their own shadows one of a libp2p
    base (an upgrade adding ``_in`` to SecureSession would otherwise be clobbered)."""
    registered = {e.path for e in node_internals.INTERNALS}
    bases = _libp2p_bases(cls)
    assert bases, f"{cls.__name__} no longer subclasses a py-libp2p class"
    problems = []
    methods = {
        name
        for name, value in vars(cls).items()
        if isinstance(value, types.FunctionType | property | staticmethod | classmethod)
        and (not name.startswith("__") or name == "__init__")
    }
    for name in sorted(methods):
        owner = next((b for b in bases if name in vars(b)), None)
        if owner is None:
            continue
        path = f"{owner.__module__}:{owner.__qualname__}.{name}"
        if path not in registered:
            problems.append(f"{cls.__name__}.{name} overrides unregistered {path}")
    for name in sorted((methods - {"__init__"}) | _assigned_in(cls)):
        for base in bases:
            if name in _assigned_in(base) or (name in vars(base) and name not in methods):
                problems.append(f"{cls.__name__}.{name} shadows {base.__qualname__}.{name}")
    assert not problems, (
        f"py-libp2p {LIBP2P}: " + "; ".join(problems) + ". Register the override in "
        "atoll.node.net.libp2p_internals.INTERNALS or rename atoll's attribute."
    )


def test_transport_module_reads_only_registered_yamux_names() -> None:
    """Every ``_yamux.<name>`` transport.py reads or writes is registered."""
    registered = {e.path for e in node_internals.INTERNALS}
    path = ROOT / "node/net/transport.py"
    tree = ast.parse(path.read_text(), str(path))
    unlisted = sorted(
        {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "_yamux"
            and node.attr != "Yamux"
            and f"libp2p.stream_muxer.yamux.yamux:{node.attr}" not in registered
        }
    )
    assert not unlisted, f"transport.py reads unregistered yamux internals: {unlisted}"
