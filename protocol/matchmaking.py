"""Matchmaking: which ready peers average one fragment's round together, and who leads.

When a peer reaches fragment ``p``'s sync step it publishes a :class:`Declaration` for
``(run, fragment, slot)`` in the DHT, where ``slot`` names the rendezvous every peer of
that sync computes alike (the swarm uses the fragment's global version, so peers of
different speeds meet; see :mod:`atoll.node.net.swarm`). Peers see each other's
declarations late and not all at once, so there is no moment at which everybody sees the
same set. Decoupled DiLoCo (arXiv 2604.21428; docs/ALGORITHMS.md §3.3, §4.1) asks for a
minimum quorum, a grace window for late peers and a cap on the group;
:class:`Matchmaker` is one peer's side of forming such a group, as a sans-IO state
machine (events in, :data:`Action` values out).

THE RULE. Two declarations can share a group only if their :func:`compat_key` is equal:
same run, fragment, slot, global version and digest of the global fragment copy, so peers
whose fragment state differs never average together. Among the compatible peers it knows
of (itself included, minus those that closed, gave up or were lost), a peer takes the one
with the lowest :func:`rank` as its leader. ``rank`` is a sha256 over run, fragment, slot
and peer id: every peer computes the same total order without talking, and the order is
reshuffled at every slot so that no peer leads every round.

- If the lowest is the peer itself, it *leads*: it accepts join requests
  (:class:`JoinRequest`) until the group holds ``max_size`` members, or until
  ``min_quorum`` members are in and ``grace_s`` has passed since the quorum was reached
  (twice that while a peer the driver expects at the slot has not joined: see
  :meth:`Matchmaker.expect`).
  Then it sends one :class:`GroupFormed` with the member list (ordered by rank, so the
  leader comes first) to every member and is :class:`Formed`. A leader that learns of a
  lower-ranked compatible peer before that moment steps down: it sends a
  :class:`Redirect` to its followers and joins the lower one itself. It may learn of it
  from the DHT or from that peer itself: a leader whose known compatible peers have not
  joined half a grace window after it began to lead sends each of them a
  :class:`JoinRequest`, which upward in rank means "I lead here" (a *nudge*; a peer that
  follows another leader stays with it, since its leader is nudged too). After GroupFormed the
  group is closed: later requests get a :class:`Disband` ("slot closed").
- Otherwise it sends a :class:`JoinRequest` to the lowest and waits for the answer:
  :class:`JoinAccept` (it now *follows* and waits for the GroupFormed), :class:`Redirect`
  (try the peer named there, which must rank strictly lower than the redirecting one) or
  :class:`Disband` (that peer is out of this slot; take the next lowest, or lead).
- Requests that reach a peer which does not lead: an accepted follower redirects the
  requester to its own leader (a live group that may take it; a lower peer merely heard
  of may have closed already, and the follower would never learn it). A peer still
  waiting for its own answer holds the request and answers once its own fate is known.
  A finished peer answers Disband. Honest peers only ask peers that rank below them.

Why members agree. A member list exists in one place only: the leader builds it once,
when it forms, and never changes it. A follower becomes :class:`Formed` only on a
GroupFormed from the peer it asked, naming itself, in rank order, and copies the list
verbatim. So every peer that ends :class:`Formed` with leader ``L`` holds ``L``'s single
list, in the same order, and a peer emits at most one :class:`Formed` per slot. A leader
accepts only requests of its own key, so a list never mixes fragment states. A peer is
also in at most one live leader's list: once accepted, a follower leaves its leader only
when that leader releases it (Redirect or Disband, after which the leader has dropped it)
or when it gives up for the slot, so two leaders never hold it at once. The exception is
a transport that reports a live peer as lost: the peer that heard it moves on, and the
supposedly lost leader may still list it.

What is *not* promised: that all ready peers of a slot end in one group (different views
may form several groups for the same slot, which is allowed: each is a valid round), and
that every listed member runs the round. A follower whose own deadline passes, or whose
transport reports its leader lost, gives up (:class:`Alone`) and tells the leader; if the
leader formed before that news arrived, its list names a peer that will not show up, and
that group's all-reduce fails as a whole (:mod:`atoll.protocol.allreduce` commits or rolls
back atomically), which costs one round and never gives a wrong result.

Silent peers. A peer whose link dropped without a goodbye answers nothing, and the
transport cannot tell: the bytes of a small request sit in a kernel buffer. With
``answer_s`` set (the driver sets it), a peer does not wait for such a leader until its
timeout. A leader re-sends its JoinAccept to every accepted follower each
``answer_s / 2`` while it collects members (a keepalive). A peer whose JoinRequest got no
answer within ``1.5 * answer_s`` (the margin covers a request held by a peer that waits
for its own answer), or a follower that heard nothing from its leader for ``answer_s``,
drops that leader for the slot: it tells it so (a Disband, in case it is only slow) and
asks the next-ranked candidate, or leads. If the dropped leader was alive after all and
forms a list naming the follower anyway, that group's all-reduce fails as a whole, as for
a lost peer below: one round, never a wrong result.

Patience for peers on their way. Peers reach a slot at different times: a node that ran
ahead of the swarm (it trained alone through a cut link, say) arrives seconds before the
others, and one that gives up after ``timeout`` misses them at every slot, since nothing
else brings it back in step. With ``patience`` set, the deadline moves once, to
``start + timeout + patience``, as soon as the peer has reason to wait: the driver names
peers it expects at this slot (:meth:`Matchmaker.expect`: they answer, train and hold this
slot's state, but have not declared yet), or its leader accepted it (a live leader decides
when the group forms or disbands, and says so). The driver holds the trainer at the
round's apply step meanwhile, which brings an early node back in step with the others.

Termination. Every wait is bounded by ``timeout`` (:attr:`Timeouts.matchmaking_s`) plus
``patience`` when extended: at the deadline a leader with a quorum forms, a leader
without one disbands its followers, and everyone else gives up: :class:`Alone` means
"train on, retry at the next slot" (the engine's ``skip``). Redirect hints strictly
lower the rank at each hop, and a peer follows at most :data:`MAX_REDIRECTS` of them per
slot. Held requests also point strictly down in rank, so holds cannot form a cycle. A
follower whose leader disbands it for lack of a quorum looks for another leader while
its own time lasts; one whose leader is lost gives up at once, so that it never sits in
the lists of two live leaders.

In step. A peer's learning-rate schedule, fragment phase and data position are all
functions of its inner step, and a group must agree on them as it agrees on the state
(a node restored from a checkpoint with a wrong step, say, would average a Δ taken at
another point of the schedule). With ``step_period`` set (the run's H) every peer states
the step at which it started the sync in its JoinRequest, JoinAccept and Disband; a
leader refuses a requester, and a follower drops a leader, whose step is not in phase
(the difference is not a multiple of H: the fragment's syncs fall at other steps) or lies
more than ``max_step_lag`` steps away (an :data:`OUT_OF_STEP` Disband naming its own
step). Which of two such peers moves is not the slot's choice: with the slot's leader
deciding, two peers that meet at every fragment (steps a whole number of periods apart)
were each refused by the other at some fragment within one period, both moved, into
each other's steps, and did so again. The step order decides instead
(:func:`step_order`, the same for every slot): whoever refused whom, a peer out of step
with one that comes before it in that order ends :class:`Alone` (when it finds no group
at the slot) with ``swarm_step``, the median of those peers' steps, before it
contributed anything; the other one stays at its step.

Out of step, never at one slot together. Two peers whose steps differ by other than about
a multiple of H sync each fragment at different times and never meet at a slot, so no
leader ever refuses either (a checkpoint restored at a wrong step does this). A peer
whose request reaches a peer that is not at that slot now, with a step further from the
receiver's trainer step than ``max_step_lag`` plus a period, may be refused at once,
without a slot (:func:`out_of_slot_refusal`): by the one of the two that comes first in
:func:`step_order`, the same for every slot, so only one of them moves.

Attempts at one slot. A slot is the fragment's version, so a peer whose round failed
declares the same slot again at its next sync of the fragment, at a later step, and the
messages of its first attempt (and its peers' answers to it) may still be on their way.
Two things keep them apart. Every message but a JoinRequest carries ``for_step``, the
receiver's step as the sender learnt it from the receiver's own messages of the slot; a
message whose ``for_step`` is not this attempt's step is ignored (a "slot closed" meant for
the first attempt would otherwise make this one drop its leader). And a leader tags its
list (:attr:`GroupFormed.group`, a hash of the leader, a nonce of the attempt and the list)
and the round runs under that tag (:attr:`~atoll.protocol.allreduce.RoundKey.group`), so
two groups of one slot never take each other's parts.

Reach. Every member of a group connects to every other for the all-reduce, and a peer
behind a NAT can dial out but cannot be dialed: two such peers cannot exchange parts,
and a group holding both fails its round for all. With ``private`` (whether a peer, this
one included, says in its record that it cannot be dialed) a leader takes at most one
such peer, itself counted, and refuses another with an :data:`UNREACHABLE` Disband; the
refused peer looks for another leader or ends alone, as after any refusal.

``declared_at`` and ``weight`` are informative (logs, future staleness rules) and never
decide anything. The machine trusts the ``sender`` field of messages: the driver checks it
against the authenticated transport peer. Time is passed in as ``now`` (any monotonic
clock, seconds); nothing here reads a clock, opens a socket or starts a thread.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, TypeGuard

from atoll.protocol.allreduce import GROUP_MAX, RoundKey
from atoll.protocol.errors import ConfigError
from atoll.protocol.manifest import GroupSettings
from atoll.protocol.messages import wire_message

__all__ = [
    "BEHIND",
    "MAX_REDIRECTS",
    "OUT_OF_STEP",
    "PAST_SLOT",
    "Action",
    "Alone",
    "CompatKey",
    "Declaration",
    "Disband",
    "Formed",
    "GroupFormed",
    "JoinAccept",
    "JoinRequest",
    "Matchmaker",
    "Message",
    "Redirect",
    "Send",
    "State",
    "compat_key",
    "out_of_slot_refusal",
    "rank",
    "step_order",
]

MAX_REDIRECTS: int = 8
"""Most Redirects one peer follows in one slot; past that it gives up for the slot."""

OUT_OF_STEP = "out of step"
UNREACHABLE = "unreachable"
"""the reason a leader refuses a peer that could not reach another member (see "Reach")"""
"""How a Disband for a step that does not fit begins (see "In step" above)."""

PAST_SLOT = "slot closed: this node is at version"
"""How the Disband of a peer that already left this slot for a later version begins
(the driver answers a JoinRequest for a slot it is past with it, then the version, and
puts its trainer's current step in the Disband's ``step``)."""

BEHIND = "behind"
"""How an :class:`Alone` reason begins when every peer this one knows of is past its slot
and nobody else is expected there: it can only copy the newer state, so it stops looking
at once instead of waiting out the deadline. The :class:`Alone`'s ``swarm_step`` is then
the median step those peers stated: where the swarm's trainers are now."""

_RANK_TAG = b"atoll/matchmaking/rank/v1"
_ID_MAX = 128  # characters of a peer id, run id or digest on the wire
_REASON_MAX = 300  # characters of a disband reason we send or repeat
_MEMBERS_MAX = 1024  # items of a member list on the wire (max_size is far below)

_ID = {"max_len": _ID_MAX}


# --------------------------------------------------------------------------------------
# the declaration and the order
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Declaration:
    """What a peer publishes in the DHT when it is ready to sync a fragment.

    ``slot`` names the rendezvous of this sync of ``fragment`` (the same number on every
    peer; the swarm uses the version). ``version`` is the fragment's global version (the round of
    :class:`~atoll.protocol.allreduce.RoundKey`) and ``digest`` a hex hash of the global
    fragment copy: peers whose copies differ must not average together. ``weight`` (tokens
    since the fragment's last sync) and ``declared_at`` (the sender's wall clock) are
    informative only.
    """

    run_id: str = field(metadata=_ID)
    fragment: int
    slot: int
    peer_id: str = field(metadata=_ID)
    version: int
    digest: str = field(metadata=_ID)
    weight: float
    declared_at: float
    step: int = -1
    """the inner step at which this peer started the sync (-1: not said); what it states
    in its JoinRequest, JoinAccept and Disband messages (see "In step" above)"""


CompatKey: TypeAlias = tuple[str, int, int, int, str]
"""``(run_id, fragment, slot, version, digest)``: only equal keys may share a group."""


def compat_key(d: Declaration) -> CompatKey:
    """The part of a declaration that must match for two peers to group together."""
    return (d.run_id, d.fragment, d.slot, d.version, d.digest)


def _rank_of(run_id: str, fragment: int, slot: int, peer_id: str) -> bytes:
    h = hashlib.sha256()
    # length-prefixed fields: no two different tuples hash the same input
    for part in (_RANK_TAG, run_id, str(fragment), str(slot), peer_id):
        data = part if isinstance(part, bytes) else part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    # the peer id after the hash breaks the (astronomically unlikely) tie of two digests
    return h.digest() + peer_id.encode("utf-8", "surrogatepass")


def out_of_slot_refusal(
    run_id: str,
    me: str,
    my_step: int,
    requester: str,
    step: object,
    *,
    step_period: int,
    max_step_lag: int,
) -> str | None:
    """The :data:`OUT_OF_STEP` reason with which peer ``me``, whose trainer is at
    ``my_step`` and which is not at the slot now, answers a JoinRequest that ``requester``
    stated ``step`` in, or None to hold the request as usual (see "Out of step, never at
    one slot together" above).

    It refuses only a step further from its own than ``max_step_lag`` plus one period
    (``my_step`` is where its trainer is now, not a sync start: a peer in step may be a
    period ahead of it), and only when its step stands between the two: its place in
    :func:`step_order` comes first. The requester, refused by the peer it asked to lead,
    ends alone with this peer's step (as when a leader refuses it at the slot) and moves
    there; the other way round, this peer holds the request and, in turn, is refused.
    """
    if not step_period or not _is_int(step) or not _is_int(my_step) or step < 0 or my_step < 0:
        return None
    gap = abs(step - my_step)
    if gap <= max(0, max_step_lag) + step_period:
        return None
    if step_order(run_id, me) > step_order(run_id, requester):
        return None
    return f"{OUT_OF_STEP}: step {step} is {gap} steps from {my_step} here"


def step_order(run_id: str, peer_id: str) -> bytes:
    """A peer's place in the order that decides, between two peers out of step that are
    never at a slot together, whose step stands (the first): the same order for every
    fragment and slot, so that of two such peers only one ever moves (with the slot's
    rank, each might be refused at another fragment and both move, into each other's
    steps)."""
    return _rank_of(run_id, -1, -1, peer_id)


def rank(d: Declaration) -> bytes:
    """The peer's place in the slot's agreed order: lower ranks lead.

    sha256 over ``run_id``, ``fragment``, ``slot`` and ``peer_id`` (length-prefixed), then
    the peer id itself, so two different peers never tie. Every peer computes the same
    order; it looks random and changes from slot to slot, so leadership rotates.
    Version and digest are left out: they only decide who may group (:func:`compat_key`).
    """
    return _rank_of(d.run_id, d.fragment, d.slot, d.peer_id)


# --------------------------------------------------------------------------------------
# messages (primitive fields only, so that the wire codec can register them)
# --------------------------------------------------------------------------------------
@wire_message(20)
@dataclass(frozen=True, slots=True)
class JoinRequest:
    """``sender`` asks the receiver to take it into its group for this key.

    ``weight`` is the sender's token count, informative; ``step`` the inner step at which
    it started the sync (-1: not said).
    """

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    slot: int
    version: int
    digest: str = field(metadata=_ID)
    weight: float
    step: int = -1


@wire_message(21)
@dataclass(frozen=True, slots=True)
class JoinAccept:
    """The leader ``sender`` has taken the receiver in; a GroupFormed follows. ``step``:
    the leader's inner step at the start of its sync (-1: not said)."""

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    slot: int
    version: int
    digest: str = field(metadata=_ID)
    step: int = -1
    for_step: int = -1
    """the receiver's step as the sender knows it (from the receiver's own messages of
    this slot; -1: not known): a message for an earlier attempt at the slot is ignored"""


@wire_message(22)
@dataclass(frozen=True, slots=True)
class Redirect:
    """``sender`` does not lead (any more); try ``leader``, which ranks lower than it.

    An empty ``leader`` means "nobody": the sender is out of this slot. To a peer that did
    not ask, a Redirect is a hint that ``leader`` exists.
    """

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    slot: int
    version: int
    digest: str = field(metadata=_ID)
    leader: str = field(metadata=_ID)
    for_step: int = -1
    """the receiver's step as the sender knows it (from the receiver's own messages of
    this slot; -1: not known): a message for an earlier attempt at the slot is ignored"""


@wire_message(23)
@dataclass(frozen=True, slots=True)
class GroupFormed:
    """The leader ``sender`` closed its group: ``members`` ordered by rank, leader first.

    Sent once per group, to every member; the list never changes afterwards.
    """

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    slot: int
    version: int
    digest: str = field(metadata=_ID)
    members: tuple[str, ...] = field(metadata={"max_len": _MEMBERS_MAX, "item_max_len": _ID_MAX})
    for_step: int = -1
    """the receiver's step as the sender knows it (from the receiver's own messages of
    this slot; -1: not known): a message for an earlier attempt at the slot is ignored"""
    group: str = field(default="", metadata={"max_len": GROUP_MAX})
    """the leader's tag for this list (:attr:`RoundKey.group
    <atoll.protocol.allreduce.RoundKey>`): the round it names is this group's alone"""


@wire_message(24)
@dataclass(frozen=True, slots=True)
class Disband:
    """``sender`` is out of the receiver's group, or out of this slot altogether.

    From a leader: the group will not form (or is already closed to newcomers). From a
    follower: it leaves (gave up, or joined elsewhere). ``reason`` is for logs.
    """

    sender: str = field(metadata=_ID)
    run_id: str = field(metadata=_ID)
    fragment: int
    slot: int
    version: int
    digest: str = field(metadata=_ID)
    reason: str = field(metadata={"max_len": _REASON_MAX})
    step: int = -1
    """the sender's inner step at the start of its sync (-1: not said): with an
    :data:`OUT_OF_STEP` reason, the step the receiver should have been near"""
    for_step: int = -1
    """the receiver's step as the sender knows it (from the receiver's own messages of
    this slot; -1: not known): a message for an earlier attempt at the slot is ignored"""


Message: TypeAlias = JoinRequest | JoinAccept | Redirect | GroupFormed | Disband


# --------------------------------------------------------------------------------------
# actions for the driver
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to peer ``to`` (best effort: a loss shows up as a timeout)."""

    to: str
    message: Message


@dataclass(frozen=True, slots=True)
class Formed:
    """The group is final: run the round with ``members`` in this order.

    ``members`` feeds :attr:`RoundSpec.members <atoll.protocol.allreduce.RoundSpec>` and
    ``key`` its key (the round is the fragment's global version). ``leader`` is
    ``members[0]``.
    """

    members: tuple[str, ...]
    leader: str
    key: RoundKey
    """its ``group`` is the leader's tag of this list (from :class:`GroupFormed`)"""
    met_at: int = -1
    """the step at which the other members started this sync, as their messages of the
    slot stated it (their median; a follower hears its leader's only); -1: unknown"""


@dataclass(frozen=True, slots=True)
class Alone:
    """No group this slot: skip the round, train on, declare again at the next slot.

    ``withdrawn``: the peer left the slot early (:meth:`Matchmaker.withdraw`), because
    the state it declared lost to another before any group formed; its Δ is untouched.
    """

    reason: str
    withdrawn: bool = False
    swarm_step: int = -1
    """when peers refused this one for being out of step: the median of their steps (the
    driver moves its trainer there); -1 otherwise"""


Action: TypeAlias = Send | Formed | Alone

State: TypeAlias = Literal["searching", "following", "leading", "formed", "alone"]
"""``searching``: no group yet (deciding, or waiting for the answer to a JoinRequest);
``following``: accepted by a leader, waiting for its GroupFormed; ``leading``: collecting
members; ``formed`` and ``alone`` are final."""


# --------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------
def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _is_id(x: object) -> bool:
    return isinstance(x, str) and 0 < len(x) <= _ID_MAX


def _declaration_problem(d: object) -> str | None:
    """Why ``d`` is not a usable declaration, or None when it is."""
    if not isinstance(d, Declaration):
        return f"not a Declaration: {type(d).__name__}"
    if not _is_id(d.run_id) or not _is_id(d.peer_id):
        return "run_id and peer_id must be non-empty strings of at most 128 characters"
    if not isinstance(d.digest, str) or len(d.digest) > _ID_MAX:
        return "digest must be a string of at most 128 characters"
    for name in ("fragment", "slot", "version"):
        value = getattr(d, name)
        if not _is_int(value) or value < 0:
            return f"{name} must be an integer >= 0, not {value!r}"
    if not _is_num(d.weight) or d.weight < 0:
        return f"weight must be finite and >= 0, not {d.weight!r}"
    if not _is_num(d.declared_at):
        return f"declared_at must be finite, not {d.declared_at!r}"
    if not _is_int(d.step) or d.step < -1:
        return f"step must be an integer >= -1, not {d.step!r}"
    return None


def _clip(text: str) -> str:
    return text if len(text) <= _REASON_MAX else text[: _REASON_MAX - 3] + "..."


# --------------------------------------------------------------------------------------
# the state machine
# --------------------------------------------------------------------------------------
class Matchmaker:
    """One peer's side of forming the group for one ``(run, fragment, slot)``.

    Feed it the DHT view (:meth:`observe`, as often as it changes), the messages of this
    key (:meth:`receive`), lost peers (:meth:`peer_lost`), the peers expected at the slot
    (:meth:`expect`) and the time (:meth:`tick` at :attr:`next_deadline`); carry out the
    :class:`Send` actions; stop at :class:`Formed` or :class:`Alone`, of which exactly one
    is returned, by ``now >= start + timeout + patience`` at the latest. The module
    docstring states the rule and what members agree on.

    Args:
        me: this peer's own declaration (its key decides who it may group with).
        settings: quorum, grace window and most members (the manifest's ``[group]``).
        now: the current time; the deadline counts from it.
        timeout: seconds until the peer stops looking for a group
            (:attr:`~atoll.protocol.manifest.Timeouts.matchmaking_s`).
        answer_s: how long a silent leader is waited for (None: until the deadline).
        patience: seconds the deadline may move once, while peers are expected at this
            slot or a leader accepted this peer (0: never; see the module docstring).
        step_period: the run's H: peers whose steps differ by other than a multiple of it
            are out of phase (0: steps are not checked; see "In step").
        max_step_lag: the most steps a groupmate's step may differ from this peer's.

    Raises:
        ConfigError: a malformed declaration, settings of the wrong type, or a time or
            timeout that is not finite (timeout also > 0).
    """

    def __init__(
        self,
        me: Declaration,
        settings: GroupSettings,
        *,
        now: float,
        timeout: float,
        answer_s: float | None = None,
        patience: float = 0.0,
        step_period: int = 0,
        max_step_lag: int = 0,
        nonce: str = "",
        private: Callable[[str], bool] | None = None,
    ) -> None:
        problem = _declaration_problem(me)
        if problem is not None:
            raise ConfigError(f"own declaration: {problem}")
        if not isinstance(settings, GroupSettings):
            raise ConfigError(f"settings must be a GroupSettings, not {type(settings).__name__}")
        if not _is_num(now):
            raise ConfigError(f"now must be finite, not {now!r}")
        if not _is_num(timeout) or timeout <= 0:
            raise ConfigError(f"timeout must be finite and > 0, not {timeout!r}")
        if answer_s is not None and (not _is_num(answer_s) or answer_s <= 0):
            raise ConfigError(f"answer_s must be finite and > 0, not {answer_s!r}")
        if not _is_num(patience) or patience < 0:
            raise ConfigError(f"patience must be finite and >= 0, not {patience!r}")
        if not _is_int(step_period) or step_period < 0 or not _is_int(max_step_lag):
            raise ConfigError("step_period and max_step_lag must be integers, step_period >= 0")
        if not isinstance(nonce, str):
            raise ConfigError(f"nonce must be a str, not {type(nonce).__name__}")
        self.private = private
        """whether a peer (this one included) cannot be dialed (behind a NAT): a leader
        takes at most one such peer into its group, itself counted (see "Reach")"""
        self.nonce = nonce
        """this attempt's own tag (the driver's random bytes), mixed into the group tag of
        a list this peer forms as leader"""
        self.step_period = step_period
        self.max_step_lag = max(0, max_step_lag)
        # peers' steps as their own messages of this slot state them (for_step)
        self._steps: dict[str, int] = {}
        # the peers out of step with this one whose step stands: their steps
        self._refused_at: dict[str, int] = {}
        self.patience = float(patience)
        self.answer_s = None if answer_s is None else float(answer_s)
        """how long a silent leader is waited for (None: until the timeout)"""
        self.me = me
        self.settings = settings
        self._id = me.peer_id
        self._compat = compat_key(me)
        self._rank = rank(me)
        self._start = float(now)
        self._deadline = float(now) + float(timeout)
        self._extended = False
        self._awaited = False  # peers are expected here that have not declared yet
        # the peers expected here that were not known at the slot when named (``expect``)
        self._due: frozenset[str] = frozenset()
        # a group formed ahead of its sync: the leader waits for these before it forms
        self._open_for: frozenset[str] = frozenset()
        self._past: dict[str, int] = {}  # peers that said they are past this slot: step
        self._state: State = "searching"
        # compatible peers known from the DHT, from hints and from requests, by rank
        self._ranks: dict[str, bytes] = {}
        # peers that are out of this slot for us: closed, gave up, lost, misbehaved
        self._excluded: set[str] = set()
        # the peer we asked (searching) or that accepted us (following)
        self._target: str | None = None
        # as leader: accepted followers and their weights, in order of acceptance
        self._accepted: dict[str, float] = {}
        self._quorum_at: float | None = None
        # JoinRequests held while our own request is unanswered (requester -> weight)
        self._held: dict[str, float] = {}
        self._redirects = 0
        self._members: tuple[str, ...] | None = None
        self._leader: str | None = None
        self._group = ""
        # when we last heard from the target (or asked it); the leader's next keepalive
        self._heard_at = float(now)
        self._keepalive_at = math.inf
        # as leader: since when, and the higher-ranked peers told so (see _nudge)
        self._led_at = math.inf
        self._nudged: set[str] = set()
        self.silent: list[str] = []
        """leaders dropped for silence in this slot, in order (for the driver's liveness)"""

    # -- queries ---------------------------------------------------------------------------
    @property
    def state(self) -> State:
        """Where the peer stands; ``formed`` and ``alone`` are final."""
        return self._state

    @property
    def key(self) -> RoundKey:
        """The round key a formed group runs under (the round is the global version, the
        group the leader's tag of its list; "" before the group formed)."""
        return RoundKey(self.me.run_id, self.me.fragment, self.me.version, self._group)

    @property
    def deadline(self) -> float:
        """``start + timeout`` (plus ``patience`` once extended): by then the peer is
        formed or alone."""
        return self._deadline

    @property
    def extended(self) -> bool:
        """Whether the deadline moved by ``patience``."""
        return self._extended

    def _extend(self) -> None:
        if not self._extended and self.patience > 0:
            self._extended = True
            self._deadline += self.patience

    @property
    def leader(self) -> str | None:
        """The leader it follows or asked (itself when leading), or None."""
        if self._state == "formed":
            return self._leader
        if self._state == "leading":
            return self._id
        return self._target

    @property
    def members(self) -> tuple[str, ...] | None:
        """The final member list once formed, else None."""
        return self._members

    @property
    def next_deadline(self) -> float | None:
        """When :meth:`tick` must next be called, or None once the outcome is known.

        Before the first event this is the start time: a tick then makes the first
        decision.
        """
        if self._state in ("formed", "alone"):
            return None
        if self._state == "searching" and self._target is None:
            return self._start
        at = self._deadline
        if self._state == "leading":
            if self._quorum_at is not None and not self._held_open():
                at = min(at, self._form_at())
            if self._unnudged():
                at = min(at, self._led_at + self.settings.grace_s / 2)
            if self._accepted:
                at = min(at, self._keepalive_at)
        silent_at = self._silent_at()
        if silent_at is not None:
            at = min(at, silent_at)
        return at

    def _silent_at(self) -> float | None:
        """When the target counts as silent (None: no target, or no bound set)."""
        if self.answer_s is None or self._target is None:
            return None
        if self._state == "following":
            return self._heard_at + self.answer_s
        return self._heard_at + 1.5 * self.answer_s

    # -- events ----------------------------------------------------------------------------
    def observe(self, declarations: Iterable[Declaration], *, now: float) -> list[Action]:
        """Take in the latest DHT view; declarations of another key are ignored.

        Call it whenever the view changes; a peer once seen stays known (a declaration
        that expires from the DHT does not remove it: Disband and :meth:`peer_lost` do).
        """
        out = self.tick(now)
        if self._state in ("formed", "alone"):
            return out
        for d in declarations:
            if _declaration_problem(d) is not None or compat_key(d) != self._compat:
                continue
            if d.peer_id != self._id:
                self._ranks.setdefault(d.peer_id, rank(d))
        out.extend(self._decide(now))
        out.extend(self._release_held(now))
        return out

    def expect(self, peers: Iterable[str], *, now: float) -> list[Action]:
        """``peers`` are expected at this slot and have not declared yet (the driver reads
        it from their records); any other than this peer, not yet known and not out of
        the slot, extends the deadline by ``patience`` (once)."""
        out = self.tick(now)
        if self._state in ("formed", "alone"):
            return out
        known = self._ranks.keys() | self._excluded | {self._id}
        due = frozenset(p for p in peers if p not in known)
        self._due |= due
        if due:
            self._awaited = True
            self._extend()
        out.extend(self._maybe_form(now))
        return out

    def hold_open(self, peers: Iterable[str], *, now: float) -> list[Action]:
        """A group formed ahead of its sync: its trainers have not reached the sync step
        yet, so a leader that could form (quorum and grace) waits instead for ``peers``,
        the peers expected at this slot, until each is a member or out of the slot. A
        peer that arrives a little late (one that copied the swarm's state and joins its
        slot) then lands in the group instead of finding it closed, at no cost to the
        others. Called again with no peers when the sync begins: the leader forms as
        usual. The deadline still holds."""
        out = self.tick(now)
        if self._state in ("formed", "alone"):
            return out
        self._open_for = frozenset(p for p in peers if p != self._id)
        out.extend(self._maybe_form(now))
        return out

    def _held_open(self) -> bool:
        """Whether a peer this leader holds its group open for is not in yet."""
        return any(p not in self._accepted and p not in self._excluded for p in self._open_for)

    def withdraw(self, reason: str, *, now: float) -> list[Action]:
        """Leave the slot before the deadline: the state this peer declared lost to
        another (the driver's rebase rule says so), so no group of this key should form.
        Followers, the leader it waits for and held requesters are told, as at a
        timeout; the outcome is :class:`Alone` with ``withdrawn`` set. Nothing happens
        once the peer is formed or alone."""
        out = self.tick(now)
        if self._state in ("formed", "alone"):
            return out
        out.extend(self._give_up(f"withdrawn: {reason}", withdrawn=True))
        return out

    def resize(self, settings: GroupSettings, *, now: float) -> list[Action]:
        """Take new group settings mid-slot (the peers that answer changed: a silent one
        no longer counts toward the quorum, say). A leader forms at once when its group
        now holds the most members, or holds the quorum and its grace is over; the grace
        window starts when the quorum is first reached."""
        if not isinstance(settings, GroupSettings):
            raise ConfigError(f"settings must be a GroupSettings, not {type(settings).__name__}")
        out = self.tick(now)
        if self._state in ("formed", "alone") or settings == self.settings:
            return out
        self.settings = settings
        if self._state == "leading":
            self._count_quorum(now)
            out.extend(self._maybe_form(now))
        return out

    def receive(self, msg: Message, *, now: float) -> list[Action]:
        """Handle a message from a peer; messages of another key or from itself are ignored."""
        out = self.tick(now)
        if not self._relevant(msg):
            return out
        if self._stale(msg):
            return out
        if isinstance(msg, JoinRequest):
            why = self._step_problem(msg.step)
            if why is not None:
                out.append(self._disband(msg.sender, f"{OUT_OF_STEP}: {why}"))
                self._out_of_step_with(msg.sender, msg.step)
                self._excluded.add(msg.sender)  # never in a group of ours: not nudged
            elif _is_num(msg.weight) and msg.weight >= 0:
                out.extend(self._on_join(msg.sender, float(msg.weight), now))
        elif self._state in ("formed", "alone"):
            if isinstance(msg, JoinAccept) and msg.sender != self._leader:
                # somebody took us in after we finished: make it drop us
                out.append(self._disband(msg.sender, f"{self._id} is {self._state} already"))
            return out
        elif isinstance(msg, JoinAccept):
            out.extend(self._on_accept(msg, now))
        elif isinstance(msg, Redirect):
            out.extend(self._on_redirect(msg, now))
        elif isinstance(msg, GroupFormed):
            out.extend(self._on_formed(msg, now))
        else:
            out.extend(self._on_disband(msg, now))
        out.extend(self._release_held(now))
        return out

    def tick(self, now: float) -> list[Action]:
        """Enforce the deadlines: close a group whose grace is over, give up at the timeout.

        Before the first observation it also makes the first decision (lead alone).
        """
        if self._state in ("formed", "alone"):
            return []
        if now >= self._deadline:
            return self._expire()
        out: list[Action] = []
        silent_at = self._silent_at()
        if silent_at is not None and now >= silent_at and self._target is not None:
            out.extend(self._drop_silent(self._target, now))
        if self._state == "leading" and self._accepted and now >= self._keepalive_at:
            self._keepalive_at = now + self._keepalive_s()
            out.extend(self._accept(f) for f in self._accepted)
        out.extend(self._decide(now))
        out.extend(self._release_held(now))
        return out

    def _unreachable(self, sender: str) -> str | None:
        """Why ``sender`` may not join this group for lack of a path between two of its
        members, or None: both it and this leader, or it and a member already taken, are
        behind NATs (neither can dial the other)."""
        if self.private is None or sender in self._accepted or not self.private(sender):
            return None
        if self.private(self._id):
            return "you and I are both behind a NAT"
        other = next((m for m in self._accepted if self.private(m)), None)
        if other is not None:
            return f"you and {other} are both behind a NAT"
        return None

    def _step_problem(self, step: object) -> str | None:
        """Why a peer that started its sync at ``step`` may not share this group, or None."""
        mine = self.me.step
        if not self.step_period or mine < 0 or not isinstance(step, int) or step < 0:
            return None
        if (step - mine) % self.step_period:
            return f"step {step} is out of phase with step {mine} (H = {self.step_period})"
        if abs(step - mine) > self.max_step_lag:
            return f"step {step} is {abs(step - mine)} steps from {mine}"
        return None

    def _out_of_step_with(self, peer: str, step: object) -> None:
        """``peer``, at ``step``, and this peer are out of step (one refused the other):
        this peer moves to that step, should it end alone, when ``peer``'s step stands,
        that is when ``peer`` comes first in :func:`step_order` (see "In step")."""
        if not _is_int(step) or step < 0:
            return
        run = self.me.run_id
        if step_order(run, peer) < step_order(run, self._id):
            self._refused_at[peer] = step

    def _keepalive_s(self) -> float:
        return math.inf if self.answer_s is None else self.answer_s / 2

    def _drop_silent(self, leader: str, now: float) -> list[Action]:
        """``leader`` did not answer within ``answer_s``: out of the slot for us; tell it
        (it may only be slow) and look again."""
        waited = now - self._heard_at
        self.silent.append(leader)
        self._excluded.add(leader)
        self._held.pop(leader, None)
        self._target = None
        self._state = "searching"
        return [self._disband(leader, f"no answer from you in {waited:.1f} s")]

    def peer_lost(self, peer: str, *, now: float) -> list[Action]:
        """The transport lost ``peer``: never ask it again, and drop what depended on it.

        A follower whose accepted leader is lost gives up for the slot (the leader may be
        alive behind a broken link, and the follower must not sit in two lists); one still
        waiting for an answer looks for another leader.
        """
        out = self.tick(now)
        if self._state in ("formed", "alone") or not isinstance(peer, str) or peer == self._id:
            return out
        self._excluded.add(peer)
        self._held.pop(peer, None)
        if peer == self._target:
            self._target = None
            if self._state == "following":
                out.extend(self._give_up(f"lost leader {peer} before the group formed"))
                return out
            self._state = "searching"
        elif self._state == "leading" and peer in self._accepted:
            del self._accepted[peer]
            self._count_quorum(now)
        out.extend(self._decide(now))
        out.extend(self._release_held(now))
        return out

    # -- the rule --------------------------------------------------------------------------
    def _lowest(self) -> str:
        """The lowest-ranked compatible peer we know that is still in the slot (maybe us)."""
        best, best_rank = self._id, self._rank
        for peer, r in self._ranks.items():
            if r < best_rank and peer not in self._excluded:
                best, best_rank = peer, r
        return best

    def _decide(self, now: float) -> list[Action]:
        """Lead, or ask the lowest; a leader that is no longer lowest steps down."""
        if self._state in ("formed", "alone") or self._target is not None:
            return []
        best = self._lowest()
        if best == self._id and self._left_behind():
            steps = [s for s in self._past.values() if s >= 0]
            return self._give_up(
                f"{BEHIND}: {len(self._past)} peer(s) are past slot {self.me.slot} "
                f"(version {self.me.version} here) and no other is expected",
                swarm_step=statistics.median_high(steps) if steps else -1,
            )
        if best == self._id:
            if self._state != "leading":
                self._state = "leading"
                self._led_at = now
                self._accepted.clear()
                self._quorum_at = None
                self._count_quorum(now)
            return self._nudge(now) + self._maybe_form(now)
        out: list[Action] = []
        if self._state == "leading":
            # step down: hand our followers to the lower peer, then join it ourselves
            out.extend(self._redirect(f, best) for f in self._accepted)
            self._accepted.clear()
            self._quorum_at = None
        self._state = "searching"
        self._target = best
        self._heard_at = now
        m = self.me
        out.append(
            Send(
                best,
                JoinRequest(*self._head(), m.weight, m.step),
            )
        )
        return out

    def _unnudged(self) -> list[str]:
        """The compatible peers known at the slot that have not joined this leader and
        were not told of it yet (none of them excluded or waiting for an answer)."""
        return [
            p
            for p in self._ranks
            if p not in self._accepted
            and p not in self._excluded
            and p not in self._held
            and p not in self._nudged
        ]

    def _nudge(self, now: float) -> list[Action]:
        """A leader tells the compatible peers it knows that have not joined it within
        half the grace window that it leads here: a :class:`JoinRequest` to a peer that
        ranks above it. Each of them knows this peer now; one that leads steps down to it
        (its followers are redirected here), one still looking asks it. After a split
        heals, the sides' records reach peers at different times: the lowest-ranked
        peer may see the others' declarations while the peer they follow has not seen
        its own, and it led alone while the rest formed without it, slot after slot."""
        if self._state != "leading" or now < self._led_at + self.settings.grace_s / 2:
            return []
        out: list[Action] = []
        m = self.me
        for p in self._unnudged():
            self._nudged.add(p)
            out.append(Send(p, JoinRequest(*self._head(), m.weight, m.step)))
        return out

    def _left_behind(self) -> bool:
        """Every peer known at this slot left it, some of them for a later version, none
        waits here (no follower, no held request) and none is expected: no group can
        form, whatever the deadline."""
        return (
            bool(self._past)
            and not self._accepted
            and not self._held
            and not self._awaited
            and all(p in self._excluded for p in self._ranks)
        )

    def _count_quorum(self, now: float) -> None:
        """Start the grace window when the quorum is reached; stop it when it is lost."""
        size = 1 + len(self._accepted)
        if size < self.settings.min_quorum:
            self._quorum_at = None
        elif self._quorum_at is None:
            self._quorum_at = now

    def _maybe_form(self, now: float) -> list[Action]:
        if self._state != "leading":
            return []
        if 1 + len(self._accepted) >= self.settings.max_size:
            return self._form()
        if self._quorum_at is not None and now >= self._form_at():
            if self._held_open():
                return []
            return self._form()
        return []

    def _form_at(self) -> float:
        """When a leader with a quorum (since ``_quorum_at``) forms: after ``grace_s``, or
        after twice that while a peer expected at the slot has not come yet (one a few
        seconds behind the others, say after a rebase, then lands in this round rather
        than finding it closed and missing it)."""
        assert self._quorum_at is not None
        grace = self.settings.grace_s
        late = any(p not in self._accepted and p not in self._excluded for p in self._due)
        return self._quorum_at + (2 * grace if late else grace)

    def _form(self) -> list[Action]:
        """Close the group: one list, sent once to every member, never changed."""
        ranks = {self._id: self._rank}
        ranks.update((p, self._ranks[p]) for p in self._accepted)
        members = tuple(sorted(ranks, key=ranks.__getitem__))
        self._state = "formed"
        self._members = members
        self._leader = self._id
        self._group = self._group_tag(members)
        self._accepted.clear()
        self._quorum_at = None
        out: list[Action] = [
            Send(
                p,
                GroupFormed(
                    *self._head(),
                    members,
                    self._steps.get(p, -1),
                    self._group,
                ),
            )
            for p in members
            if p != self._id
        ]
        out.append(Formed(members, self._id, self.key, self._met_at(members)))
        return out

    def _met_at(self, members: tuple[str, ...]) -> int:
        steps = [self._steps[p] for p in members if p != self._id and p in self._steps]
        return statistics.median_low(steps) if steps else -1

    def _group_tag(self, members: tuple[str, ...]) -> str:
        """The tag of the list this peer forms as leader: a hash of the leader, this
        attempt (its nonce, step and declaration time) and the list, so that two attempts
        at one slot by the same members name two rounds."""
        m = self.me
        h = hashlib.sha256(_RANK_TAG + b"/group")
        for part in (self._id, self.nonce, str(m.step), repr(m.declared_at), *members):
            data = part.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "big"))
            h.update(data)
        return h.hexdigest()[:32]

    def _expire(self) -> list[Action]:
        """The timeout: form with a quorum, otherwise give up (and tell whom it concerns)."""
        if self._state == "leading" and 1 + len(self._accepted) >= self.settings.min_quorum:
            return self._form()
        size = 1 + len(self._accepted) if self._state == "leading" else 0
        if self._state == "leading":
            reason = f"timeout: {size} of the {self.settings.min_quorum} peers of the quorum"
        elif self._state == "following":
            reason = f"timeout: leader {self._target} did not close its group in time"
        else:
            reason = "timeout: no group found"
        return self._give_up(reason)

    def _give_up(
        self, reason: str, *, withdrawn: bool = False, swarm_step: int = -1
    ) -> list[Action]:
        """End alone; followers, the peer we wait for and held requesters are told."""
        out: list[Action] = [self._disband(f, reason) for f in self._accepted]
        if self._target is not None:
            out.append(self._disband(self._target, reason))
        self._state = "alone"
        self._accepted.clear()
        self._target = None
        self._quorum_at = None
        out.extend(self._release_held(self._deadline))
        if self._refused_at:
            swarm_step = statistics.median_high(self._refused_at.values())
            reason = (
                f"{OUT_OF_STEP} with {len(self._refused_at)} peer(s) whose step stands, at "
                f"step {swarm_step}; this node started at {self.me.step}; then {reason}"
            )
        out.append(Alone(reason, withdrawn, swarm_step))
        return out

    # -- handlers --------------------------------------------------------------------------
    def _relevant(self, msg: object) -> bool:
        return (
            isinstance(msg, JoinRequest | JoinAccept | Redirect | GroupFormed | Disband)
            and _is_id(msg.sender)
            and msg.sender != self._id
            and (msg.run_id, msg.fragment, msg.slot, msg.version, msg.digest) == self._compat
            and _is_int(msg.fragment)
            and _is_int(msg.slot)
            and _is_int(msg.version)
        )

    @property
    def stated_steps(self) -> dict[str, int]:
        """Each peer's step as its own messages of this slot stated it (a copy)."""
        return dict(self._steps)

    def _stale(self, msg: Message) -> bool:
        """Whether ``msg`` is for an earlier attempt of this peer at this slot (its
        ``for_step`` names another step than ours: a failed round's slot is tried again
        at a later sync step), and is to be ignored; else note the sender's own step."""
        if not isinstance(msg, JoinRequest):
            aimed = msg.for_step
            if _is_int(aimed) and aimed >= 0 and self.me.step >= 0 and aimed != self.me.step:
                return True
        stated = getattr(msg, "step", -1)
        if isinstance(msg, JoinRequest | JoinAccept | Disband) and _is_int(stated) and stated >= 0:
            self._steps[msg.sender] = stated
        return False

    def _on_join(self, sender: str, weight: float, now: float) -> list[Action]:
        """Answer a request now (leader, follower, finished) or hold it (searching)."""
        if self._state == "formed":
            return [self._disband(sender, "slot closed: the group has formed")]
        if self._state == "alone":
            return [self._disband(sender, "slot closed: gave up for this slot")]
        r = _rank_of(self.me.run_id, self.me.fragment, self.me.slot, sender)
        if r < self._rank:
            # a peer below us says it leads here (its nudge): know it, and step down to
            # it or ask it, unless it is out of the slot for us; a follower stays with
            # its leader, which hears the same
            if sender in self._excluded:
                return [self._disband(sender, "you rank below me: I cannot lead you")]
            self._ranks.setdefault(sender, r)
            return self._decide(now)
        self._ranks.setdefault(sender, r)
        if self._state == "leading" and (why := self._unreachable(sender)) is not None:
            self._excluded.add(sender)
            return [self._disband(sender, f"{UNREACHABLE}: {why}")]
        if self._state == "leading":
            if sender not in self._accepted:
                if not self._accepted:
                    self._keepalive_at = now + self._keepalive_s()
                self._accepted[sender] = weight
                self._count_quorum(now)
            out: list[Action] = [self._accept(sender)]
            out.extend(self._maybe_form(now))
            return out
        if self._state == "following":
            # Our leader is a live group that may take the requester; a lower peer we only
            # heard of may be closed already, and we would never learn it (we do not talk
            # to it), so pointing there could send the requester back and forth.
            return [self._redirect(sender, str(self._target))]
        # searching with a request out: answer once we know our own fate
        self._held[sender] = weight
        return []

    def _release_held(self, now: float) -> list[Action]:
        """Answer the held requests once we lead, follow or are finished."""
        if not self._held or (self._state == "searching" and self._target is not None):
            return []
        held = list(self._held.items())
        self._held.clear()
        out: list[Action] = []
        for peer, weight in held:
            out.extend(self._on_join(peer, weight, now))
        return out

    def _on_accept(self, msg: JoinAccept, now: float) -> list[Action]:
        why = self._step_problem(msg.step)
        if msg.sender == self._target and why is not None:
            # a leader out of step with this peer: leave it and look again
            self._out_of_step_with(msg.sender, msg.step)
            self._excluded.add(msg.sender)
            self._target = None
            self._state = "searching"
            out: list[Action] = [self._disband(msg.sender, f"{OUT_OF_STEP}: {why}")]
            out.extend(self._decide(now))
            return out
        if msg.sender == self._target:
            if self._state == "searching":
                self._state = "following"
            self._heard_at = now  # also a leader's keepalive
            self._extend()  # a live leader says when its group forms or disbands
            return []
        # a late accept from a peer we no longer wait for: make it drop us
        return [self._disband(msg.sender, f"{self._id} is not waiting for you any more")]

    def _on_redirect(self, msg: Redirect, now: float) -> list[Action]:
        hint, sender = msg.leader, msg.sender
        me = self.me
        hint_rank = _rank_of(me.run_id, me.fragment, me.slot, hint) if _is_id(hint) else b""
        # a hint must point strictly down in rank, so that chains of redirects end
        sound = (
            bool(hint_rank)
            and hint != self._id
            and hint_rank < _rank_of(me.run_id, me.fragment, me.slot, sender)
        )
        if sound and hint not in self._excluded:
            self._ranks.setdefault(hint, hint_rank)
        if sender == self._target:
            self._target = None
            self._state = "searching"
            if not sound:
                # "nobody", or a hint that goes nowhere: that peer is out of the slot for us
                self._excluded.add(sender)
            # A sound hint we know to be out (closed, gone) only means that the sender's
            # view is older than ours: it stays a candidate, and asking it again gets a
            # held request or a newer answer. The redirect cap bounds the back and forth.
            self._redirects += 1
            if self._redirects > MAX_REDIRECTS:
                return self._give_up(f"followed {MAX_REDIRECTS} redirects without a group")
        return self._decide(now)

    def _on_formed(self, msg: GroupFormed, now: float) -> list[Action]:
        if msg.sender != self._target:
            return []  # not from the peer we joined: not our group
        members = msg.members
        problem = self._members_problem(msg.sender, members)
        if problem is not None:
            self._excluded.add(msg.sender)
            self._target = None
            self._state = "searching"
            out: list[Action] = [self._disband(msg.sender, f"bad member list: {problem}")]
            out.extend(self._decide(now))
            return out
        self._state = "formed"
        self._members = tuple(members)
        self._leader = msg.sender
        self._group = msg.group if isinstance(msg.group, str) else ""
        self._target = None
        return [Formed(self._members, msg.sender, self.key, self._met_at(self._members))]

    def _members_problem(self, leader: str, members: object) -> str | None:
        """Why a GroupFormed's list cannot be ours, or None when it can."""
        if not isinstance(members, tuple) or not all(_is_id(p) for p in members):
            return "not a tuple of peer ids"
        if not self.settings.min_quorum <= len(members) <= self.settings.max_size:
            return f"{len(members)} members, outside [min_quorum, max_size]"
        if len(set(members)) != len(members):
            return "duplicate members"
        if self._id not in members:
            return "it does not name me"
        if members[0] != leader:
            return "the leader is not first"
        m = self.me
        ranks = [_rank_of(m.run_id, m.fragment, m.slot, p) for p in members]
        if any(a >= b for a, b in itertools.pairwise(ranks)):
            return "not ordered by rank"
        return None

    def _on_disband(self, msg: Disband, now: float) -> list[Action]:
        sender = msg.sender
        if (
            sender == self._target
            and isinstance(msg.reason, str)
            and msg.reason.startswith(OUT_OF_STEP)
        ):
            self._out_of_step_with(sender, msg.step)
        if isinstance(msg.reason, str) and msg.reason.startswith(PAST_SLOT):
            stated = msg.step if _is_int(msg.step) and msg.step >= 0 else -1
            self._past.setdefault(sender, stated)
        self._excluded.add(sender)
        self._held.pop(sender, None)
        if sender == self._target:
            # the leader will not (or no longer) take us: look again while time lasts
            self._target = None
            self._state = "searching"
        elif self._state == "leading" and sender in self._accepted:
            del self._accepted[sender]
            self._count_quorum(now)
        return self._decide(now)

    # -- messages --------------------------------------------------------------------------
    def _head(self) -> tuple[str, str, int, int, int, str]:
        """The fields every message of this slot begins with: sender, run, fragment, slot,
        version, digest."""
        m = self.me
        return (self._id, m.run_id, m.fragment, m.slot, m.version, m.digest)

    def _accept(self, to: str) -> Send:
        m = self.me
        return Send(
            to,
            JoinAccept(
                *self._head(),
                m.step,
                self._steps.get(to, -1),
            ),
        )

    def _redirect(self, to: str, leader: str) -> Send:
        return Send(
            to,
            Redirect(
                *self._head(),
                leader,
                self._steps.get(to, -1),
            ),
        )

    def _disband(self, to: str, reason: str) -> Send:
        m = self.me
        return Send(
            to,
            Disband(
                *self._head(),
                _clip(reason),
                m.step,
                self._steps.get(to, -1),
            ),
        )
