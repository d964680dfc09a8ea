"""The restart's live view as the operator reads it (AppTest of console/restart.py, no engine needed): a start
past its ETA says how far over it is, and never shows a countdown that stands still."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest


def show(overrun_s: float | None, remaining_s: float | None, elapsed_s: float = 140.0) -> str:
    def script(overrun: float | None, remaining: float | None, elapsed: float) -> None:
        from console.restart import phases
        from engine.schemas import StartupPhase, StartupView

        phases(StartupView(revision=7, elapsed_s=elapsed, phase="warmup", phase_title="Warm-up request",
                           phases=[StartupPhase(name="warmup", title="Warm-up request", started_s=37.7,
                                                seconds=102.3, done=False)],
                           eta_s=40.0, eta_basis="about 40 s, the median of 3 earlier starts",
                           remaining_s=remaining, overrun_s=overrun))

    at = AppTest.from_function(script, args=(overrun_s, remaining_s, elapsed_s)).run()
    assert not at.exception, [e.value for e in at.exception]
    return "\n".join(c.value for c in at.caption)


def test_a_start_past_its_eta_says_it_overruns_and_by_how_much() -> None:
    text = show(overrun_s=100.0, remaining_s=None)
    assert "taking longer than expected" in text and "100.0 s over" in text
    assert "left" not in text


def test_a_start_on_time_counts_down_and_agrees_with_the_figures_beside_it() -> None:
    """"s left" disagreed with the time so far and the expected time shown beside it (issue 31): it is their
    difference now, whatever the phases' own estimate says."""
    from console import fmt

    text = show(overrun_s=None, remaining_s=2.3, elapsed_s=30.0)
    assert f"about {fmt.seconds(10.0)} left" in text and "expected about 40 s" in text, text
