"""Many models on one GPU: whom the room puts to sleep for a deployment that must come back (the least recently used
idle ones that may sleep, only as many as it needs), why it waits otherwise; and what pre-flight says of deployments
whose memory adds up to more than the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from engine.capacity import Neighbour, check
from engine.serving import Tenant
from engine.serving.residency import make_room
from tests.unit.test_capacity import H200
from tests.unit.test_preflight import gpu_settings

GPU = {"gpu0": 1.0}


def tenant(name: str, share: float = 0.45, **kw: object) -> Tenant:
    values: dict[str, object] = {"holds": True, "sleeps": True, "idle": True, "last_active": 0.0, **kw}
    return Tenant(name, {"gpu0": share}, **values)  # type: ignore[arg-type]


def test_it_fits_beside_those_awake_and_starts_at_once() -> None:
    room = make_room(tenant("a", holds=False), [tenant("b"), tenant("c", 0.5, holds=False)], GPU, 100.0)
    assert room.fits and room.evict == ()


def test_the_least_recently_used_idle_one_sleeps_and_only_as_many_as_needed() -> None:
    others = [tenant("b", last_active=50.0), tenant("c", last_active=10.0), tenant("d", 0.1, last_active=5.0)]
    room = make_room(tenant("a", 0.45, holds=False), others, GPU, 100.0)
    # d is the least recently used but too small alone; c (next) is enough with it: b, used last, stays awake
    assert not room.fits and room.evict == ("d", "c")
    assert room.waiting is not None and "d (idle 95 s), c (idle 90 s)" in room.waiting


def test_one_never_called_goes_first() -> None:
    room = make_room(tenant("a", 0.85, holds=False), [tenant("b", 0.5, last_active=1.0),
                                                      tenant("c", 0.5, last_active=None)], GPU, 10.0)
    assert room.evict == ("c", "b")
    assert "never called" in (room.waiting or "")


def test_while_those_chosen_are_leaving_nobody_else_is_put_to_sleep() -> None:
    others = [tenant("b", 0.85, leaving=True), tenant("c", 0.1)]
    room = make_room(tenant("a", 0.85, holds=False), others, GPU, 10.0)
    assert not room.fits and room.evict == () and room.waiting == "waiting for b to sleep"


def test_busy_and_pinned_neighbours_are_not_moved_and_the_wait_names_them() -> None:
    others = [tenant("b", 0.5, sleeps=False), tenant("c", 0.4, idle=False)]
    room = make_room(tenant("a", 0.5, holds=False), others, GPU, 10.0)
    assert not room.fits and room.evict == ()
    assert room.waiting == ("no room beside its neighbours: b is pinned awake (no scale_to_zero_after_s); "
                            "c is serving")


def test_two_waiting_do_not_block_each_other_and_other_gpus_do_not_count() -> None:
    waiting = tenant("b", 0.85, holds=False, idle=False)  # waits for room itself: holds nothing
    elsewhere = Tenant("c", {"gpu1": 0.9}, holds=True, sleeps=False)
    assert make_room(tenant("a", 0.85, holds=False), [waiting, elsewhere], {"gpu0": 1.0, "gpu1": 1.0}, 1.0).fits


def test_without_a_reading_it_is_not_held_back() -> None:
    assert make_room(tenant("a", 0.9, holds=False), [tenant("b", 0.9, sleeps=False)], {}, 1.0).fits




def test_preflight_lets_deployments_that_sleep_share_a_gpu_and_says_which_sleep(m8b: Path) -> None:
    beside = [Neighbour("b", gpus=(0,), utilization=0.85, sleeps=True),
              Neighbour("c", gpus=(0,), utilization=0.85, sleeps=True)]
    result = check(gpu_settings(m8b, scale_to_zero_after_s=600), data_dir=None, device=H200, neighbours=beside,
                   sleep_mode=True)
    assert result.errors == []
    found = {w.code: w for w in result.warnings}["neighbours_sleep"]
    assert "only while deployments b, c sleep" in found.message and "about a second" in found.message
    assert "pinned" not in found.message
    pinned = check(gpu_settings(m8b), data_dir=None, device=H200, neighbours=beside)
    said = {w.code: w for w in pinned.warnings}["neighbours_sleep"].message
    assert "pinned awake" in said and "b, c cannot wake" in said and "cold start" in said


def test_preflight_refuses_what_does_not_fit_beside_a_pinned_neighbour_and_says_how_it_could(m8b: Path) -> None:
    beside = [Neighbour("b", gpus=(0,), utilization=0.85), Neighbour("c", gpus=(0,), utilization=0.85, sleeps=True)]
    result = check(gpu_settings(m8b, scale_to_zero_after_s=600), data_dir=None, device=H200, neighbours=beside)
    error = {e.code: e for e in result.errors}["neighbours_memory"]
    assert "(or let b sleep when idle: scale_to_zero_after_s" in error.message


def test_preflight_says_when_the_weights_asleep_do_not_fit_the_host(m8b: Path) -> None:
    sleeping = gpu_settings(m8b, scale_to_zero_after_s=600)
    tight = check(sleeping, data_dir=None, device=H200, sleep_mode=True, host_available=8 * 1024**3)
    said = {w.code: w for w in tight.warnings}["sleep_host_memory"].message
    assert "move to the host's memory, which has 8.00 GiB available" in said and "cold start" in said
    roomy = check(sleeping, data_dir=None, device=H200, sleep_mode=True, host_available=100 * 1024**3)
    assert "sleep_host_memory" not in {w.code for w in roomy.warnings}
    no_sleep = check(gpu_settings(m8b), data_dir=None, device=H200, sleep_mode=True, host_available=8 * 1024**3)
    assert "sleep_host_memory" not in {w.code for w in no_sleep.warnings}


def test_the_one_that_put_neighbours_to_sleep_keeps_its_turn() -> None:
    """a puts b to sleep; while it waits for b's memory, b (woken by a request of its own) may not take the room."""
    from types import SimpleNamespace

    from engine.serving import Residency

    class Member:
        def __init__(self, name: str, tenant: Tenant) -> None:
            self.deployment = SimpleNamespace(name=name)
            self._tenant = tenant
            self.evicted: list[str] = []

        def settings_claimed(self) -> object:
            return object()

        def tenant(self, claims: dict[str, float]) -> Tenant:
            return self._tenant

        def evict(self, reason: str) -> None:
            self.evicted.append(reason)

        def wake(self) -> None:
            pass

    a = Member("a", Tenant("a", {"gpu0": 0.85}, holds=False, sleeps=True, idle=False, last_active=5.0))
    b = Member("b", Tenant("b", {"gpu0": 0.85}, holds=True, sleeps=True, idle=True, last_active=1.0))
    clock = [10.0]
    members: list[Any] = [a, b]
    room = Residency(lambda: members, lambda m, _s: cast(Any, m)._tenant.claims, lambda: {"gpu0": 1.0},
                     lambda: clock[0])
    first = room.make_room(a, object())  # type: ignore[arg-type]
    assert first.evict == ("b",) and b.evicted and "make room for a" in b.evicted[0]
    b._tenant = Tenant("b", {"gpu0": 0.85}, holds=False, sleeps=True, idle=False, last_active=1.0)  # asleep, asked for
    clock[0] = 11.0
    assert not room.make_room(b, object()).fits  # type: ignore[arg-type]  # a's turn first
    assert room.make_room(a, object()).fits  # type: ignore[arg-type]
    clock[0] = 200.0  # a never came back for it: its turn is forgotten after RESERVE_S
    room.reserved["a"] = 11.0
    assert room.make_room(b, object()).fits  # type: ignore[arg-type]
