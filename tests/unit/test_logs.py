"""vLLM's log as the on-call engineer filters it: lines classified by what they mean (a failure, or the shutdown
of a planned stop), not by vLLM's level tag alone, and the leak reports of every exit folded. Real logs."""

from __future__ import annotations

from pathlib import Path

from engine.vllm import filter_log

LOGS = Path(__file__).parent.parent / "fixtures" / "vllm_logs"
# A real engine's log (vLLM 0.32 CPU build, the demo model): instance a started, a restart ran blue/green (b
# started beside a, a was stopped: vLLM printed an ERROR traceback and ~40 lines of leak reports while shutting
# down), then a forced revision with max_model_len 4096 failed to start (a pydantic "Value error", no ERROR tag).
SWAP_THEN_FAIL = (LOGS / "cpu-swap-then-fail-max-len.log").read_text().splitlines()


def errors(lines: list[str]) -> list[str]:
    return filter_log(lines, hide_polling=True, level="error", contains=None)


def test_errors_only_shows_the_failed_start_and_not_the_planned_swap() -> None:
    shown = errors(SWAP_THEN_FAIL)
    text = "\n".join(shown)
    assert "Value error, User-specified max_model_len (4096) is greater than the derived max_model_len" in text
    assert "pydantic_core._pydantic_core.ValidationError" in text  # the exception line of the traceback
    assert "EngineDeadError" not in text and "output_handler failed" not in text  # a's shutdown, asked for
    assert not any("leaked" in ln for ln in shown)


def test_warnings_and_up_leave_out_a_planned_stop() -> None:
    shown = filter_log(SWAP_THEN_FAIL, hide_polling=True, level="warning", contains=None)
    assert not any("force killing" in ln for ln in shown)  # vLLM's own shutdown of instance a
    assert any("Found ulimit" in ln for ln in shown)  # a real warning stays
    assert any("Value error" in ln for ln in shown)


def test_leak_reports_of_an_exit_are_folded_into_one_line() -> None:
    everything = filter_log(SWAP_THEN_FAIL, hide_polling=False, level="debug", contains=None)
    leaks = [ln for ln in everything if "leaked" in ln or "leak reports" in ln]
    assert len(leaks) == 1, leaks
    assert "lines of leak reports at exit" in leaks[0] and leaks[0].startswith("[a] ")
    raw = filter_log(SWAP_THEN_FAIL, hide_polling=False, level="debug", contains=None, fold=False)
    assert len(raw) == len(SWAP_THEN_FAIL) and sum("leaked" in ln for ln in raw) > 25


def test_a_failure_without_instance_marks_is_an_error_too() -> None:
    lines = (LOGS / "cpu-fail-max-len-above-model.log").read_text().splitlines()
    shown = errors(lines)
    assert any("Value error, User-specified max_model_len (4096)" in ln for ln in shown)
    assert not any("non-default args" in ln for ln in shown)


def test_the_engines_marks_say_which_stops_were_planned_and_which_exits_were_not() -> None:
    lines = ["===== llmops: instance a, revision 3: python -m vllm... =====",
             "[a] (APIServer pid=1) INFO 12-01 [x.py:1] Starting vLLM server",
             "===== llmops: stopping instance a (revision 3) on purpose: what it prints while it shuts down is "
             "not a failure =====",
             "[a] (APIServer pid=1) ERROR 12-01 [async_llm.py:906] AsyncLLM output_handler failed.",
             "===== llmops: instance b, revision 4: python -m vllm... =====",
             "[b] (EngineCore pid=2) ERROR 12-01 [core.py:9] EngineCore failed to start.",
             "===== llmops: instance b (revision 4) exited with code 1 without being asked to stop ====="]
    assert errors(lines) == lines[5:7]
