"""Autoscaling and scale to zero: how many replicas one deployment wants now, from the load the gateway sees.

The signal is the requests in flight (running in vLLM and waiting in the gateway's queue) averaged over the last
SMOOTH_S; the target is ``target_in_flight`` per replica (0.75 x max_num_seqs when empty). The count a deployment
wants moves up only when the load has asked for more for ``scale_up_delay_s`` without a break, and down only when
one replica fewer would have carried it for ``scale_down_delay_s``; it stays within ``min_replicas`` and
``max_replicas`` (``replicas``, fixed, without max_replicas). After ``scale_to_zero_after_s`` with no request it
wants none; a request that arrives then wants one at once, without a delay (it waits in the gateway's queue).

Pure: the controller samples the load at each tick, asks for the count between operations, and records each
decision (an event with its reason and the signal's value). Everything time-dependent takes ``now`` (the
controller's clock)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

from engine.revisions import EngineSettings

IDLE_GRACE_S = 0.2  # quiet this long (no request in flight, none let through) before it is idle for a neighbour
SMOOTH_S = 5.0  # the load is averaged over this window (a client between two requests is not a drop)
TARGET_SHARE = 0.75  # the default target: this share of max_num_seqs in flight per replica

Action = Literal["up", "down", "to_zero", "wake"]


@dataclass(frozen=True)
class Policy:
    """One revision's scaling settings."""

    replicas: int
    min_replicas: int
    max_replicas: int | None
    target: float
    up_delay_s: float
    down_delay_s: float
    zero_after_s: float | None
    queue_target: float | None = None  # target_queue_wait_s: scale up on queue wait (an SLO), not on in-flight

    @classmethod
    def of(cls, settings: EngineSettings) -> Policy:
        return cls(settings.replicas, settings.min_replicas, settings.max_replicas,
                   settings.target_in_flight or max(1.0, TARGET_SHARE * settings.max_num_seqs),
                   settings.scale_up_delay_s, settings.scale_down_delay_s, settings.scale_to_zero_after_s,
                   settings.target_queue_wait_s)

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas is not None

    @property
    def floor(self) -> int:
        return self.min_replicas if self.autoscaled else self.replicas

    @property
    def ceiling(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas

    def clamp(self, n: int) -> int:
        return max(self.floor, min(self.ceiling, n))


@dataclass(frozen=True)
class Decision:
    """A change of the count wanted: from, to, why, and the signal's value then."""

    action: Action
    before: int
    after: int
    reason: str
    load: float


class Autoscaler:
    """The replica count one deployment wants, by its policy and the load it has seen."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()  # (when, requests in flight and waiting)
        self.want: int | None = None  # None until the first policy is seen
        self.last_active: float | None = None  # when a request was last in flight or waiting
        self._pressure: tuple[Literal["up", "down"], int, float] | None = None  # (way, count asked, since)
        self.held: str | None = None  # why the count does not move although the load asks (the status says it)
        self.slept_at: float | None = None  # when it last went to zero
        self._admitted = 0  # the admission's count of requests let through, at the last sample
        self.policy: Policy | None = None  # the latest one seen
        self.evicting: str | None = None  # asked to sleep for a neighbour (why), until the next decision
        self._current = 0.0  # the latest sample (the smoothed load lags a request that has ended)
        self.queue_wait = 0.0  # the longest wait in the gateway's queue of the last SMOOTH_S (or one waiting now)

    # --- what the controller feeds in -------------------------------------------------------------------------

    def sample(self, now: float, in_flight: int, waiting: int, admitted: int = 0, queue_wait: float = 0.0) -> None:
        """The load now; ``admitted``: the admission's count of requests ever let through (a request that came
        and went between two samples still counts as activity); ``queue_wait``: the admission's longest wait of
        the last SMOOTH_S."""
        self.queue_wait = queue_wait
        load = float(in_flight + waiting)
        self._current = load
        self._samples.append((now, load))
        while self._samples and self._samples[0][0] < now - SMOOTH_S:
            self._samples.popleft()
        if load > 0 or admitted != self._admitted or self.last_active is None:
            self.last_active = now
        self._admitted = admitted

    def quiet(self, now: float, admitted: int) -> bool:
        """No request let through since the last sample and none for IDLE_GRACE_S: between two requests of one
        client (a gap of a few ms) a deployment is not idle enough to be put to sleep for a neighbour."""
        return admitted == self._admitted and (self.last_active is None or now - self.last_active >= IDLE_GRACE_S)

    def evict(self, reason: str) -> None:
        """A neighbour needs the memory (many models on one GPU): to zero at the next decision, unless a request
        waits for this one by then."""
        self.evicting = reason

    def reset(self) -> None:
        """An operator started or restarted it: the revision's own count again (asleep or not), decided anew."""
        self.want, self._pressure, self.held, self.evicting = None, None, None, None

    def touch(self, now: float) -> None:
        """Nothing serves, or it was just started by hand: idle time counts from now (a stopped or failed
        deployment is not idle, it is down)."""
        self.last_active = now

    @property
    def load(self) -> float:
        """The requests in flight and waiting over the last SMOOTH_S, each sample weighted by the time since the
        one before (ticks come in bursts: probes and watchers wake the loop)."""
        samples = list(self._samples)
        if len(samples) < 2:
            return samples[0][1] if samples else 0.0
        spans = [(b[0] - a[0], b[1]) for a, b in pairwise(samples)]
        total = sum(span for span, _ in spans)
        if total <= 0:
            return sum(v for _, v in samples) / len(samples)
        return sum(span * v for span, v in spans) / total

    @property
    def asleep(self) -> bool:
        return self.want == 0

    # --- what it wants ----------------------------------------------------------------------------------------

    def decide(self, policy: Policy, now: float, waiting: int, serving: int) -> Decision | None:
        """The count wanted now is ``self.want``; a Decision when it changed (the controller records it).
        ``serving``: the instances that serve now (none: a start, a stop or a failure; never idle)."""
        self.policy = policy
        if self.want is None:  # the engine starts: the revision's own count, within its bounds
            self.want = policy.clamp(policy.replicas)
            self.last_active = now if self.last_active is None else self.last_active
        before, load = self.want, self.load
        evicting, self.evicting = self.evicting, None
        if evicting is not None and self.want != 0 and waiting == 0:
            self.slept_at = now
            return self._to(0, "to_zero", before, load, evicting)
        if self.want == 0:
            if waiting > 0 or self._current > 0:
                asleep = f" after {now - self.slept_at:.0f} s asleep" if self.slept_at is not None else ""
                return self._to(policy.floor, "wake", before, load, f"a request arrived{asleep}")
            if policy.zero_after_s is None:
                return self._to(policy.floor, "wake", before, load, "scale_to_zero_after_s is off now")
            return None
        if serving == 0:
            self.touch(now)
        if policy.zero_after_s is not None and self.last_active is not None \
                and now - self.last_active >= policy.zero_after_s:
            self.slept_at = now
            return self._to(0, "to_zero", before, load,
                            f"no request for {now - self.last_active:.0f} s (scale_to_zero_after_s "
                            f"{policy.zero_after_s:g})")
        if not policy.autoscaled:
            self.held = None
            self._pressure = None
            if self.want != policy.replicas:  # a new fixed count, or back from zero at the floor
                return self._to(policy.replicas, "up" if policy.replicas > before else "down", before, load,
                                f"the revision runs {policy.replicas} replica(s)")
            return None
        if self.want < policy.floor or self.want > policy.ceiling:  # new bounds: in effect at once
            self.held = None  # said at the old max_replicas: the next tick says it again at the new one, if so
            return self._to(policy.clamp(self.want), "up" if self.want < policy.floor else "down", before, load,
                            f"min_replicas {policy.floor}, max_replicas {policy.ceiling}")
        asked = math.ceil(load / policy.target - 1e-9) if load > 0 else 0
        if policy.queue_target is not None:  # the SLO decides up; in-flight only says how far down is safe
            if self.queue_wait > policy.queue_target:  # one more than serve now: none while one is starting
                asked = max(self.want, serving + 1)
            elif self.queue_wait > 0:
                asked = max(asked, self.want)  # some waited, within the target: no fewer
            else:
                asked = min(asked, self.want)
        wanted = policy.clamp(asked)
        self.held = (f"the load asks for {asked} replicas; max_replicas is {policy.ceiling}"
                     if asked > policy.ceiling and self.want >= policy.ceiling else None)
        if wanted == self.want:
            self._pressure = None
            return None
        way: Literal["up", "down"] = "up" if wanted > self.want else "down"
        delay = policy.up_delay_s if way == "up" else policy.down_delay_s
        since = now if self._pressure is None or self._pressure[0] != way else self._pressure[2]
        self._pressure = (way, wanted, since)  # the way holds since then; the count is the latest asked
        if now - since < delay:
            return None
        self._pressure = None
        held_for = f"for {now - since:.0f} s"
        why = (f"requests waited up to {self.queue_wait:.1f} s in the gateway's queue, above target_queue_wait_s "
               f"{policy.queue_target:g}, {held_for}" if way == "up" and policy.queue_target is not None else
               f"{load:.1f} requests in flight, {load / self.want:.1f} per replica, above the target of "
               f"{policy.target:g} {held_for}" if way == "up" else
               f"{load:.1f} requests in flight: {wanted} replica(s) carry them within the target of "
               f"{policy.target:g} per replica, {held_for}")
        return self._to(wanted, way, before, load, why)

    def cooling(self, now: float) -> str | None:
        """What the count waits for (a delay under way), for the status."""
        if self._pressure is None or self.policy is None:
            return None
        way, wanted, since = self._pressure
        delay = self.policy.up_delay_s if way == "up" else self.policy.down_delay_s
        left = max(0.0, delay - (now - since))
        return f"to {wanted} replica(s) in {left:.0f} s if the load holds (scale_{way}_delay_s {delay:g})"

    def _to(self, after: int, action: Action, before: int, load: float, reason: str) -> Decision:
        self.want = after
        if action in ("to_zero", "wake"):  # what was pending or held before is not this state's
            self._pressure, self.held = None, None
        return Decision(action, before, after, reason, round(load, 2))
