"""Many models on one GPU (issue 33): deployments whose memory adds up to more than a GPU holds, with no more of
them awake at once than fits. A deployment that must come back (a request for one asleep, an operator's start)
first looks whether it fits beside those awake; when it does not, the least recently used idle neighbours that may
sleep are put to sleep (vLLM's sleep mode on CUDA; stopped on the CPU build) and it waits for them.

Pure: the registry describes each deployment as a Tenant (what it claims of each GPU, or of the host, while awake;
whether it holds that now; whether it may be put to sleep for another; how long it has been idle) and asks
``make_room`` for one of them; the answer says whether it may start now, which neighbours to put to sleep, or why
it waits. A deployment without ``scale_to_zero_after_s`` is pinned awake: it is never put to sleep for another."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.revisions import EngineSettings as Settings
    from engine.serving.controller import Controller as Member
else:
    Settings = Any
    Member = Any

EPSILON = 1e-9
RESERVE_S = 60.0  # how long one that put neighbours to sleep keeps its turn while it waits for their memory


@dataclass(frozen=True)
class Tenant:
    """One deployment as the room sees it. ``claims``: per resource (``gpu0``, ``gpu1``… a share of the GPU's
    memory; ``host``: bytes) what it takes while awake. ``holds``: it takes that now (an instance of it is not
    asleep, or it was let in and is starting); ``leaving``: it is being put to sleep (for another, or idle).
    ``sleeps``: it may be put to sleep for another (it scales to zero); ``idle``: nothing in flight or waiting and
    no operation under way; ``last_active``: the clock's time of its last request (None: never). One that waits for
    room holds nothing: two that wait do not block each other, the first to find room takes it."""

    name: str
    claims: dict[str, float] = field(default_factory=dict)
    holds: bool = False
    leaving: bool = False
    sleeps: bool = False
    idle: bool = True
    last_active: float | None = None


@dataclass(frozen=True)
class Room:
    """The answer: ``fits`` (start now), else ``evict`` (the neighbours to put to sleep now, least recently used
    first) and ``waiting`` (what it waits for, said to the operator)."""

    fits: bool
    evict: tuple[str, ...] = ()
    waiting: str | None = None


def _fits(me: Tenant, others: list[Tenant], capacity: dict[str, float]) -> bool:
    # a resource without a reading is not checked (vLLM's own start says whether it fits)
    return all(me.claims[r] + sum(t.claims.get(r, 0.0) for t in others) <= capacity.get(r, math.inf) + EPSILON
               for r in me.claims)


def make_room(me: Tenant, others: list[Tenant], capacity: dict[str, float], now: float) -> Room:
    """Whether ``me`` may come back now beside ``others`` within ``capacity`` (per resource), else whom to put to
    sleep first, else why it waits."""
    shared = [t for t in others if t.name != me.name and any(r in t.claims for r in me.claims)]
    if _fits(me, [t for t in shared if t.holds], capacity):
        return Room(True)
    staying = [t for t in shared if t.holds and not t.leaving]
    leaving = [t.name for t in shared if t.leaving and t.holds]
    if _fits(me, staying, capacity):
        return Room(False, waiting=f"waiting for {_names(leaving)} to sleep")
    movable = sorted((t for t in staying if t.sleeps and t.idle),
                     key=lambda t: (t.last_active if t.last_active is not None else float("-inf"), t.name))
    chosen: list[Tenant] = []
    for tenant in movable:
        chosen.append(tenant)
        if _fits(me, [t for t in staying if t not in chosen], capacity):
            said = ", ".join(f"{t.name} ({_idle(t, now)})" for t in chosen)
            return Room(False, tuple(t.name for t in chosen),
                        f"putting {said} to sleep to make room (least recently used first)")
    blockers = [f"{t.name} is pinned awake (no scale_to_zero_after_s)" for t in staying if not t.sleeps] + \
        [f"{t.name} is serving" for t in staying if t.sleeps and not t.idle]
    if not blockers:
        return Room(False, waiting="it does not fit on its GPU even with every neighbour asleep")
    return Room(False, waiting="no room beside its neighbours: " + "; ".join(blockers))


def _names(names: list[str]) -> str:
    return ", ".join(names) if names else "its neighbours"


def _idle(tenant: Tenant, now: float) -> str:
    if tenant.last_active is None:
        return "never called"
    return f"idle {max(0.0, now - tenant.last_active):.0f} s"


class Residency:
    """The room shared by the deployments of one host: each one's controller asks it before it comes back (its
    ``make_room``), and it puts the neighbours chosen to sleep (their ``evict``). ``members``: the controllers
    (duck-typed: ``deployment.name``, ``tenant(claims)``, ``settings_claimed()``, ``evict(reason)``, ``wake()``);
    ``claims``: what one's settings take while awake, per resource (on CUDA a share of each of its GPUs, on the
    CPU build bytes of the host); ``capacity``: what each resource holds; ``now``: the controllers' clock."""

    def __init__(self, members: Callable[[], list[Member]], claims: Callable[[Member, Settings], dict[str, float]],
                 capacity: Callable[[], dict[str, float]], now: Callable[[], float]) -> None:
        self.members = members
        self.claims = claims
        self.capacity = capacity
        self.now = now
        # who put neighbours to sleep and waits for their memory (since when): it comes back first, before one of
        # those put to sleep that a request wakes meanwhile; forgotten once it fits, or after RESERVE_S
        self.reserved: dict[str, float] = {}

    def attach(self, member: Member) -> None:
        member.make_room = lambda settings, evict: self.make_room(member, settings, evict)
        member.released = self.released

    def make_room(self, member: Member, settings: Settings, evict: bool = True) -> Room:
        """Whether ``member`` may come back with ``settings`` now; with ``evict``, the neighbours chosen are put
        to sleep for it."""
        others = [m for m in self.members() if m is not member]
        tenants: list[Tenant] = []
        for other in others:
            theirs = other.settings_claimed()
            tenants.append(other.tenant(self.claims(other, theirs) if theirs is not None else {}))
        me = member.tenant(self.claims(member, settings))
        if not me.claims:
            return Room(True)
        now = self.now()
        name = member.deployment.name
        self.reserved = {n: t for n, t in self.reserved.items() if now - t < RESERVE_S}
        tenants = [dataclasses.replace(t, holds=True, idle=False) if t.name in self.reserved and t.claims
                   and self.reserved[t.name] < self.reserved.get(name, math.inf) else t for t in tenants]
        room = make_room(me, tenants, self.capacity(), now)
        if room.fits:
            self.reserved.pop(name, None)
        elif room.evict:
            self.reserved.setdefault(name, now)
        by_name = {m.deployment.name: m for m in others}
        for name in room.evict if evict else ():
            tenant = next(t for t in tenants if t.name == name)
            by_name[name].evict(f"put to sleep to make room for {member.deployment.name} (least recently used "
                                f"of the deployments on its GPU: {_idle(tenant, now)})")
        return room

    def released(self) -> None:
        """A member's memory came back: those waiting for room look again now."""
        for member in self.members():
            member.wake()
