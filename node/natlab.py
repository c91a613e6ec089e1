"""A NAT lab of network namespaces: home nodes behind NAT routers, beside public ones.

Volunteers' machines sit behind a home router's NAT, often behind a carrier's too. This
lab builds that on one machine, with no outside network, to test how nodes reach each
other (:class:`NatLab`)::

    with NatLab(public=1, homes=("cone", "symmetric", "double")) as lab:
        subprocess.run([*lab.public_prefix(0), sys.executable, "server.py"])
        subprocess.run([*lab.home_prefix(1), sys.executable, "client.py", lab.public_ip(0)])

Topology. The public segment is a :class:`~atoll.node.netlab.NetLab`: the public nodes
and each home's outer router have an address on its bridge. A home is a router namespace
whose ``eth0`` is on the public segment and whose ``lan0`` leads to the home node's own
namespace (``eth0``, a private /24 of ``10.232.0.0/16``, default route through the
router)::

    home node [eth0 10.232.h.2] == [lan0 10.232.h.1] router [eth0 public] == bridge

The router forwards and rewrites the source of what leaves by ``eth0`` (iptables
MASQUERADE); nothing entering by ``eth0`` is forwarded or answered unless it belongs to
a connection the home side opened (conntrack): the rest is dropped silently, as home
routers do, so a home node can dial out but cannot be dialed, and a dial at it times
out. The kinds, as RFC 4787 names their behaviour:

- ``cone``: MASQUERADE keeps the home node's source port where it can and reuses the
  mapping for every destination (endpoint-independent mapping); what comes in must
  answer what went out. Hole punching works through it.
- ``symmetric``: MASQUERADE ``--random-fully``: every connection gets a random public
  port (address-and-port-dependent mapping), so the address a peer observed is no use to
  another peer; hole punching fails.
- ``double``: a ``cone`` home router behind a carrier router (also ``cone``), whose own
  private segment is ``100.64.h.0/24``: peers see the carrier's address.

Clean-up is the public lab's: its namespaces and the lab's own are removed by
:meth:`NatLab.close` (also at exit, on SIGTERM, and by the next lab after a SIGKILL),
whatever failed. :func:`~atoll.node.netlab.available` says whether a lab can run here.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Sequence
from types import TracebackType
from typing import Literal

from atoll.node.netlab import LabError, NetLab, ns_pids

__all__ = ["HOME_NET", "KINDS", "NatKind", "NatLab"]

NatKind = Literal["cone", "symmetric", "double"]
KINDS: tuple[NatKind, ...] = ("cone", "symmetric", "double")
HOME_NET = ipaddress.IPv4Network("10.232.0.0/16")
"""each home's private /24 is one of this /16 (the home node at .2, its router at .1)"""
CARRIER_NET = ipaddress.IPv4Network("100.64.0.0/16")
"""a ``double`` home's carrier segment is one /24 of this /16 (shared address space)"""
MAX_HOMES = 50


class NatLab:
    """``public`` nodes on a public segment and one home node behind a NAT per entry of
    ``homes`` (see the module docstring). Built when constructed; LabError when a step
    fails (what was built is removed first)."""

    def __init__(self, public: int, homes: Sequence[str], *, handle_signals: bool = True) -> None:
        kinds = list(homes)
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            raise LabError(f"unknown NAT kinds {bad}: use {', '.join(KINDS)}")
        if not kinds or len(kinds) > MAX_HOMES:
            raise LabError(f"a NAT lab has 1 to {MAX_HOMES} homes, not {len(kinds)}")
        if public < 1:
            raise LabError(f"a NAT lab has at least one public node, not {public}")
        self.kinds: tuple[NatKind, ...] = tuple(kinds)  # type: ignore[arg-type]
        self.public = public
        # the outer router of each home is a node of the public lab, after the public nodes
        self.lab = NetLab(public + len(kinds), handle_signals=handle_signals)
        self.homes: list[str] = []
        self.routers: dict[int, str] = {}
        """the home router's namespace of each ``double`` home (behind the carrier's)"""
        try:
            base = public + len(kinds)
            for h, kind in enumerate(self.kinds):
                self._build_home(h, kind, base + 2 * h)
        except BaseException:
            with contextlib.suppress(LabError):
                self.lab.close()
            raise

    # -- building ----------------------------------------------------------------------------
    def _link(self, outer: str, inner: str, net: ipaddress.IPv4Network, what: str) -> None:
        """A veth from router namespace ``outer`` (``lan0``, .1 of ``net``) to namespace
        ``inner`` (``eth0``, .2), with ``inner``'s default route through ``outer``."""
        run = self.lab.command
        veth = ["link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", inner]
        run(["ip", "-n", outer, *veth], f"linking {what}")
        router, host = net.network_address + 1, net.network_address + 2
        run(["ip", "-n", outer, "addr", "add", f"{router}/24", "dev", "lan0"], f"{what}: router")
        run(["ip", "-n", inner, "addr", "add", f"{host}/24", "dev", "eth0"], f"{what}: address")
        for ns, dev in ((outer, "lan0"), (inner, "eth0")):
            run(["ip", "-n", ns, "link", "set", dev, "up"], f"{what}: {dev} up")
        run(["ip", "-n", inner, "route", "add", "default", "via", str(router)], f"{what}: route")

    def _nat(self, router: str, kind: str, what: str) -> None:
        """Make namespace ``router`` a NAT router from ``lan0`` to ``eth0``."""
        self.lab.sysctl(router, "net/ipv4/ip_forward", "1")
        masquerade = "-A POSTROUTING -o eth0 -j MASQUERADE"
        if kind == "symmetric":
            masquerade += " --random-fully"
        rules = "\n".join(
            [
                "*nat",
                ":PREROUTING ACCEPT [0:0]",
                ":INPUT ACCEPT [0:0]",
                ":OUTPUT ACCEPT [0:0]",
                ":POSTROUTING ACCEPT [0:0]",
                masquerade,
                "COMMIT",
                "*filter",
                ":INPUT ACCEPT [0:0]",
                ":FORWARD DROP [0:0]",
                "-A INPUT -i eth0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                "-A INPUT -i eth0 -j DROP",
                ":OUTPUT ACCEPT [0:0]",
                "-A FORWARD -i lan0 -o eth0 -j ACCEPT",
                "-A FORWARD -i eth0 -o lan0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                "COMMIT",
                "",
            ]
        )
        self.lab.command(
            ["ip", "netns", "exec", router, "iptables-restore"], f"{what}: NAT rules", stdin=rules
        )

    def _build_home(self, h: int, kind: NatKind, index: int) -> None:
        """Home ``h`` behind the public lab's node ``public + h`` (its outer router); its
        own namespaces take indices ``index`` and ``index + 1``."""
        outer = self.lab.names[self.public + h]
        node = self.lab.add_namespace(index, f"home {h}")
        self.homes.append(node)
        lan = list(HOME_NET.subnets(new_prefix=24))[1 + h]
        if kind == "double":  # the public lab's node is the carrier's router
            router = self.lab.add_namespace(index + 1, f"home {h}'s router")
            self.routers[h] = router
            carrier = list(CARRIER_NET.subnets(new_prefix=24))[1 + h]
            self._link(outer, router, carrier, f"home {h}'s carrier segment")
            self._nat(outer, "cone", f"home {h}'s carrier router")
            self._link(router, node, lan, f"home {h}")
            self._nat(router, "cone", f"home {h}'s router")
        else:
            self._link(outer, node, lan, f"home {h}")
            self._nat(outer, kind, f"home {h}'s router")

    # -- addresses ---------------------------------------------------------------------------
    def _home(self, h: int) -> None:
        if not 0 <= h < len(self.kinds):
            raise LabError(f"no home {h} in a lab of {len(self.kinds)} (0..{len(self.kinds) - 1})")

    def _public(self, i: int) -> None:
        if not 0 <= i < self.public:
            raise LabError(f"no public node {i} in a lab of {self.public}")

    def public_ip(self, i: int) -> str:
        """Public node ``i``'s address."""
        self._public(i)
        return self.lab.ip(i)

    def public_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program in public node ``i``'s namespace."""
        self._public(i)
        return self.lab.prefix(i)

    def home_ip(self, h: int) -> str:
        """Home node ``h``'s own (private) address."""
        self._home(h)
        return str(list(HOME_NET.subnets(new_prefix=24))[1 + h].network_address + 2)

    def wan_ip(self, h: int) -> str:
        """The public address home ``h``'s connections come from (its outer router's)."""
        self._home(h)
        return self.lab.ip(self.public + h)

    def home_prefix(self, h: int) -> list[str]:
        """The command prefix that runs a program in home node ``h``'s namespace."""
        self._home(h)
        if self.lab.closed:
            raise LabError("the lab is closed")
        return ["ip", "netns", "exec", self.homes[h]]

    def pids(self) -> list[int]:
        """The processes running in any of the lab's namespaces."""
        return [p for name in self.lab.namespaces for p in ns_pids(name)]

    # -- clean-up ----------------------------------------------------------------------------
    def close(self) -> None:
        """End what runs in the lab and remove every namespace (see NetLab.close)."""
        self.lab.close()

    def __enter__(self) -> NatLab:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.lab.__exit__(exc_type, exc, tb)
