"""The start ETA table replayed over real starts, out of sample: each start's estimate is made from the starts
before it only (as the engine made it at the time), of the kind it was launched as, and compared with what it
took. The records are the ``ready`` events' data of real starts (tests/fixtures/starts/: this 2-core host through
the real engine, python -m bench start-kinds; an H200, bench/results/2026-12-01-h200/)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.serving.eta import Company, PastStart, StartKind, cache_cold, estimate, past_start, past_wake, start_kind

STARTS = Path(__file__).parent.parent / "fixtures" / "starts"
TOLERANCE = 0.20


@dataclass
class Replayed:
    start: PastStart
    kind: StartKind  # as launched
    eta_s: float
    basis: str
    loaded: bool

    @property
    def error(self) -> float:
        return (self.eta_s - self.start.total_s) / self.start.total_s


def records(name: str) -> tuple[dict[str, Any], list[PastStart]]:
    doc = json.loads((STARTS / name).read_text())
    out = []
    for r in doc["starts"]:
        start = past_start(r) if "startup" in r else past_wake(r, None)
        assert start is not None, r
        out.append(start)
    return doc, out


COMPANY: dict[StartKind, Company] = {"cold": "alone", "warm": "alone", "beside": "beside", "beside_cold": "beside",
                                     "bridge": "bridge", "wake": "wake"}


def replay(starts: list[PastStart], build: str) -> list[Replayed]:
    """Each start estimated as the engine launches it now: its company as recorded, its compile cache expected
    cold or warm from the starts before it (cache_cold), not as it was recorded at the time."""
    done: list[Replayed] = []
    for i, start in enumerate(starts):
        recorded: StartKind = start.kind or start.effective_kind
        launched = recorded if start.compile_key is None else start_kind(  # no key recorded: as it was launched
            COMPANY[recorded], cache_cold(start.compile_key, starts[:i]))
        eta = estimate(start.compile_key or "", start.model or "", starts[:i], kind=launched, build=build,
                       load_1m=start.load_1m, cores=start.cores)
        done.append(Replayed(start, launched, eta.total_s, eta.basis, eta.loaded))
    return done


def table(rows: list[Replayed]) -> str:
    return "\n".join(f"{r.kind:12} took {r.start.total_s:6.1f} s, estimate {r.eta_s:6.1f} s ({r.basis}, "
                     f"{100 * r.error:+.0f} %){' loaded' if r.loaded else ''}" for r in rows)


def test_cpu_starts_of_each_kind_are_estimated_within_20_percent_from_the_earlier_ones_of_their_kind() -> None:
    """The run of 2026-12-03 on this host, with the scheduler's sessions weighted (the CPU priors come from it). Of
    its estimates made from earlier starts of the same kind on a host not loaded, all but one are within 20 %; that
    one is a start beside a serving instance estimated from the single one before it, +20.1 % (121 s against 145 s:
    its torch.compile phase took 21 s against 32 s). With the median of the last five starts' totals (the estimate
    before the process phase came from the latest start) five of eight were outside 20 %, up to +34 %: this host's
    process phase fell from 43-62 s to 34-37 s within the hour. Asserted: at most one in six outside 20 %, none
    outside 25 %."""
    _, starts = records("cpu-2026-12-03.json")
    rows = replay(starts, "cpu")
    kinds = {r.kind for r in rows}
    assert {"cold", "warm", "beside", "beside_cold"} <= kinds, kinds  # every kind this host can produce
    measured = [r for r in rows if r.basis == "kind" and not r.loaded]
    assert len(measured) >= 6, table(rows)
    off = [r for r in measured if abs(r.error) > TOLERANCE]
    assert len(off) <= len(measured) // 6, "\n" + table(rows)
    assert all(abs(r.error) <= 0.25 for r in measured), "\n" + table(rows)


def test_the_earlier_cpu_run_is_estimated_within_20_percent_but_for_one_start() -> None:
    """The run of 2026-12-01, before the sessions were weighted. All but one estimate from earlier starts of the
    kind within 20 %: a warm start that took 35.4 s, its process phase 23.7 s against the 38.2 s of the latest start
    alone before it, the host at a load of 4.5 after minutes at 25 (+46 %; +28 % from the median of the two warm
    starts before it, whose process phases were 29 and 35 s)."""
    _, starts = records("cpu-2026-12-01.json")
    rows = replay(starts, "cpu")
    measured = [r for r in rows if r.basis == "kind" and not r.loaded]
    assert len(measured) >= 6, table(rows)
    off = [r for r in measured if abs(r.error) > TOLERANCE]
    assert len(off) <= 1 and all(r.kind == "warm" and r is measured[-1] for r in off), "\n" + table(rows)


def test_a_start_at_a_load_far_above_its_basis_is_said_to_be_loaded() -> None:
    """The first start of the run (load 19 on 2 cores, from the build's default) and the first under 16 clients
    (load 23) carry the note; no start at a load under 2 a core does."""
    _, starts = records("cpu-2026-12-01.json")
    rows = replay(starts, "cpu")
    assert any(r.loaded for r in rows), table(rows)
    for r in rows:
        if r.start.load_1m is not None and r.start.cores and r.start.load_1m < 2 * r.start.cores:
            assert not r.loaded, table(rows)


@pytest.mark.parametrize("name", ["cpu-2026-12-01.json", "cpu-2026-12-03.json", "h200-2026-12-01.json",
                                  "h200-2026-12-04.json", "h200-2026-12-04b.json"])
def test_a_kind_with_no_earlier_start_gets_a_prior_and_the_next_one_a_measurement(name: str) -> None:
    _, starts = records(name)
    rows = replay(starts, "cuda" if name.startswith("h200") else "cpu")
    firsts: dict[str, Replayed] = {}
    for r in rows:
        if r.kind in firsts:
            assert r.basis == "kind", f"a second {r.kind} start is estimated from the first"
        else:
            firsts[r.kind] = r
            assert r.basis in ("prior", "default")


def test_h200_starts_replayed() -> None:
    """The H200's starts of one apply session, replayed: a cold start from the build's default, a bridge from the
    cold start by the prior ratio, the warm start from the bridges' by theirs. The second bridge took 64 s
    against the first's 88 s (its CUDA-graph phase 2 s against 17 s, the process phase 46 against 53 s): within
    one kind the GPU's own starts differed by 38 %, which bounds what any estimate from one earlier start holds
    (+34 %)."""
    _, starts = records("h200-2026-12-01.json")
    rows = replay(starts, "cuda")
    by_kind = {(r.kind, i): r for i, r in enumerate(rows)}
    assert [r.kind for r in rows] == ["cold", "bridge", "beside_cold", "bridge", "warm", "wake"]
    assert all(abs(r.error) <= 0.40 for r in rows), table(rows)
    assert abs(by_kind[("warm", 4)].error) <= TOLERANCE


def test_h200_starts_of_2026_12_04_are_each_within_20_percent() -> None:
    """The engine's starts of the H200 session of 2026-12-04 (the cap against a restart): the first start on a fresh
    machine from the build's default (the CUDA priors hold the first starts measured on three days, this one among
    them: in-sample), a bridge by the prior ratio, the new revision beside the idle bridge from the first start (a
    cold one too: +20 %, the first start on a machine is slower in every phase but its imports, which come from the
    latest start), the ceiling back beside the old instance by the prior ratio. Each within 20 %."""
    _, starts = records("h200-2026-12-04.json")
    rows = replay(starts, "cuda")
    assert [r.kind for r in rows] == ["cold", "bridge", "cold", "beside_cold"], table(rows)
    assert [r.basis for r in rows] == ["default", "prior", "kind", "prior"], table(rows)
    assert all(abs(r.error) <= TOLERANCE for r in rows), "\n" + table(rows)


def test_h200_starts_of_the_second_session_of_2026_12_04_are_each_within_20_percent() -> None:
    """Every kind of start the H200 makes, out of sample but the first (the build's default) and the pause start,
    whose kind comes from the rule these starts suggested (cache_missed): a bridge by the
    prior ratio, the new revision beside the idle bridge (expected warm: its compile key was started before), a
    second bridge from the first, a new max_model_len (cold, from the cold starts), a pause to 0.95 (its key
    started just before; vLLM had compiled again on the earlier repeat, so expected cold: launched as warm at the
    time it was estimated at 56 s and took 96 s, -41 %), two wake-ups after vLLM refused a revision. Each within
    20 %."""
    _, starts = records("h200-2026-12-04b.json")
    rows = replay(starts, "cuda")
    assert [r.kind for r in rows] == ["cold", "bridge", "warm", "bridge", "cold", "cold", "wake", "wake"], table(rows)
    assert [r.basis for r in rows] == ["default", "prior", "prior", "kind", "kind", "kind", "default", "kind"]
    assert all(abs(r.error) <= TOLERANCE for r in rows), "\n" + table(rows)
