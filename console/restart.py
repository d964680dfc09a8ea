"""A vLLM restart as a person watches it: the phases of the start as they happen, with elapsed times and the ETA
from this engine's earlier starts, and the events around it (drained, stopped, failed, rolled back)."""

from __future__ import annotations

import time
import zlib
from typing import Any

import streamlit as st

from console import fmt
from console.deployment import scope  # an apply is watched per deployment
from console.widgets import client, kept_expander, own_rerun
from engine.schemas import ApplyPlanOut, ApplyProgress, EventOut, StartupView, StatusOut

PROGRESS_KINDS = ["settings_changed", "apply_plan", "drained", "stopped", "starting", "ready", "failed", "diagnosis",
                  "rollback", "restart_scheduled", "crash_loop", "model_missing", "demo_model_building",
                  "demo_model_built", "sleeping", "woken", "bridge_failed", "instance_failed", "apply_done",
                  "autoscale"]
ROLE_ICON = {"serving": ":material/check_circle:", "bridge": ":material/alt_route:",
             "starting": ":material/progress_activity:", "draining": ":material/hourglass_bottom:",
             "stopping": ":material/stop_circle:", "sleeping": ":material/bedtime:", "failed": ":material/error:"}
EVENT_ICON = {"ready": ":material/check_circle:", "failed": ":material/error:", "rollback": ":material/undo:",
              "diagnosis": ":material/troubleshoot:", "crash_loop": ":material/dangerous:"}


def phases(view: StartupView) -> None:
    """The start's phases, one line each: done (with its time), running now (with its time so far), ETA."""
    for phase in view.phases:
        icon = ":material/check:" if phase.done else ":material/progress_activity:"
        st.markdown(f"{icon} **{phase.title}** · +{phase.started_s:.0f} s · {fmt.seconds(phase.seconds)}"
                    + ("" if phase.done else " so far"))
    if view.ready_s is not None:
        error = f", expected {fmt.seconds(view.eta_s)}: off by {view.error_s:+.0f} s" if view.eta_s is not None \
            and view.error_s is not None else ""
        st.caption(f"Ready after {fmt.seconds(view.ready_s)}{error}.")
    elif view.failed:
        st.caption(f"The start failed after {fmt.seconds(view.elapsed_s)}: {view.failed}")
    elif view.overrun_s is not None:
        st.caption(f"{fmt.seconds(view.elapsed_s)} so far: taking longer than expected, "
                   f"{fmt.seconds(view.overrun_s)} over (expected {view.eta_basis}; now: {view.phase_title}).")
    elif view.eta_s is not None:
        # what is left is the expectation less the time so far, the two figures shown beside it (a separate
        # estimate of the phases left disagreed with them)
        left = f"; about {fmt.seconds(max(0.0, view.eta_s - view.elapsed_s))} left"
        st.caption(f"{fmt.seconds(view.elapsed_s)} so far; expected {view.eta_basis}{left}.")
    else:
        st.caption(f"{fmt.seconds(view.elapsed_s)} so far; no earlier start of this engine to estimate from.")


def plan_text(plan: ApplyPlanOut) -> str:
    """The plan in one paragraph (its kind, why, what clients should expect, how long): engine.schemas writes it
    once for the console and the CLI."""
    return plan.summary()


def step_lines(plan: ApplyPlanOut) -> list[str]:
    """The plan's steps, each with what it should take and what that is taken from (older engines: the texts)."""
    if not plan.step_etas:
        return [f"{i + 1}. {step}" for i, step in enumerate(plan.steps)]
    return [f"{i + 1}. {s.text} · " + (f"**{fmt.seconds(s.eta_s)}** ({s.basis})" if s.eta_s is not None else
                                       f"time not known ({s.basis})") for i, s in enumerate(plan.step_etas)]


def plan_eta_text(plan: ApplyPlanOut) -> str:
    """How long the apply should take in all, as the sum of its steps."""
    if plan.expected_s is None:
        return "How long it takes is not known yet."
    parts = [f"{s.action} {fmt.seconds(s.eta_s)}" for s in plan.step_etas if s.eta_s]
    return f"It should take about {fmt.seconds(plan.expected_s)}" + (f" ({' + '.join(parts)})" if parts else "") + "."


def plan_box(plan: ApplyPlanOut) -> None:
    st.markdown(plan_text(plan))
    lines = step_lines(plan)
    if lines:
        st.markdown("\n".join(lines))
    if plan.eta_note:
        st.caption(f"About these times: {plan.eta_note}.")
    for warning in plan.warnings:
        st.warning(warning, icon=":material/warning:")


def timings_text(progress: ApplyProgress) -> str:
    """The apply's steps so far as they ran, each against what its plan expected."""
    done = [f"{t.action} {t.instance} {fmt.seconds(t.seconds)}"
            + (f" (expected {fmt.seconds(t.eta_s)})" if t.eta_s is not None else "") for t in progress.timings]
    return " · ".join(done)


def instances(now: StatusOut) -> None:
    """The vLLM instances, which serve, and the start of any that is starting."""
    for inst in now.instances:
        where = f" · GPU {inst.device}" if inst.device else ""
        load = f" · {inst.outstanding} in flight" if inst.serving else ""
        st.markdown(f"{ROLE_ICON.get(inst.role, '')} instance **{inst.name}** · revision {inst.revision} · "
                    f"{inst.role}{' (takes requests)' if inst.serving else ''}{where}{load}")
        if inst.startup is not None:
            with st.container(border=True):
                st.markdown(f"**Starting revision {inst.startup.revision}** on instance {inst.name}")
                phases(inst.startup)


def timeline(events: list[EventOut], t0: float) -> list[str]:
    return [f"+{max(0.0, e.ts.timestamp() - t0):.0f} s **{e.kind}** {e.message}" for e in events]


def watch(revision: int, what: str) -> None:
    """Follow the restart that applies ``revision`` (an apply or a rollback): its events from now on, timed from
    now; the page reruns to show it."""
    marker = client().events(limit=1, newest_first=True)
    st.session_state[f"applying{scope()}"] = {"revision": revision, "since": marker[0].id if marker else 0,
                                    "t0": time.time(), "what": what}
    st.session_state.pop(f"apply_outcome{scope()}", None)
    st.rerun()


def outcome(applying: dict[str, Any], now: StatusOut, events: list[EventOut]) -> tuple[str, str] | None:
    """How an apply ended, once it has: ("success" | "error", message); None while it goes on."""
    rev_id = applying["revision"]
    view = now.startup
    settled = len(now.instances) <= max(1, sum(1 for i in now.instances if i.revision == rev_id and i.serving))
    if now.state == "ready" and now.running_revision == rev_id and settled:
        took = time.time() - applying["t0"]
        gap = ""
        if now.apply is not None and now.apply.revision == rev_id and now.apply.plan.kind != "start":
            longest = now.apply.longest_gap_s or 0.0
            gap = (f" Nothing paused: something served throughout ({now.apply.plan.title})."
                   if longest == 0 else f" The longest stretch with nothing serving was {fmt.seconds(longest)}.")
        eta = ""
        if now.apply is not None and now.apply.revision == rev_id and now.apply.plan.expected_s is not None \
                and now.apply.finished is not None:
            took_apply = (now.apply.finished - now.apply.started).total_seconds()
            gap += (f" The apply took {fmt.seconds(took_apply)} against {fmt.seconds(now.apply.plan.expected_s)} "
                    f"expected ({took_apply - now.apply.plan.expected_s:+.0f} s).")
        if view is not None and view.revision == rev_id and view.ready_s is not None and view.eta_s is not None:
            eta = f" vLLM's start took {fmt.seconds(view.ready_s)} against {fmt.seconds(view.eta_s)} expected " \
                  f"({view.error_s:+.0f} s)." if view.error_s is not None else ""
        return "success", f"Revision {rev_id} is ready after {took:.0f} s.{gap}{eta}"
    slept = any(e.kind == "autoscale" and e.revision == rev_id and (e.data or {}).get("action") == "to_zero"
                for e in events)
    if slept and now.autoscale is not None and now.autoscale.asleep:  # idle already: it went to zero at once
        took = time.time() - applying["t0"]
        return "success", (f"Revision {rev_id} is applied after {took:.0f} s; the deployment was idle, so it is "
                           "scaled to zero now: the next request wakes it.")
    rolled_back = any(e.kind == "rollback" and e.revision == rev_id for e in events)
    if rolled_back and now.state == "ready" and not any(i.role == "starting" for i in now.instances):
        diagnosis = next((e for e in events if e.kind == "diagnosis" and e.revision == rev_id), None)
        return "error", (f"Revision {rev_id} did not start and was rolled back to revision {now.running_revision}."
                         + (f"  \n**{diagnosis.data.get('kind')}**: {diagnosis.data.get('explanation')}  \nFix: "
                            f"{diagnosis.data.get('fix')}" if diagnosis else ""))
    if now.halted:
        return "error", f"Restarts are halted: {now.halted}"
    return None


@st.fragment(run_every=1)
def progress(shown: tuple[int | None, str] | None = None) -> None:
    """While this session applies a revision (or vLLM is starting for any reason): the start, live. ``shown``: the
    running revision and state the page around it was drawn with; once an apply that this session did not start
    (another tab's, a colleague's, or this one's before a reload) has ended on something else, the whole page is
    drawn again — it kept "revision N is being applied" for as long as nobody reloaded (issue 31)."""
    applying = st.session_state.get(f"applying{scope()}")
    now = client().status()
    if not applying:
        busy = now.state in ("starting", "draining", "stopping") or any(i.role != "serving" for i in now.instances)
        if shown is not None and not busy and (now.running_revision, str(now.state)) != shown and own_rerun():
            st.rerun(scope="app")
        if busy and (now.startup is not None or now.instances):
            st.subheader(f"vLLM is {now.state}" if now.state != "ready" else "vLLM is changing instances")
            st.info(now.reason, icon=":material/autorenew:")
            if now.apply is not None and now.apply.outcome == "running":
                plan_box(now.apply.plan)
            instances(now)
        return
    events = client().events(since=applying["since"], kinds=PROGRESS_KINDS, limit=200)
    st.subheader(f"{applying.get('what', 'Applying')} revision {applying['revision']}")
    lines = timeline(events, applying["t0"])
    if now.apply is not None and now.apply.revision == applying["revision"]:
        ran = timings_text(now.apply)
        st.info(f"Plan: {plan_text(now.apply.plan)}  \nNow: {now.apply.step}"
                + (f"  \nSo far: {ran}" if ran else ""), icon=":material/route:")
    for ev, line in zip(events, lines, strict=True):
        st.markdown(f"{EVENT_ICON.get(ev.kind, ':material/arrow_right:')} {line}")
    instances(now)
    if not now.instances and now.startup is not None and now.state == "starting":
        with st.container(border=True):
            st.markdown(f"**Starting revision {now.startup.revision}**")
            phases(now.startup)
    ended = outcome(applying, now, events)
    if ended is None and now.autoscale is not None and now.autoscale.asleep:
        # idle already, it may have gone to zero before this watch began: its decision is older than the marker
        ended = outcome(applying, now, client().events(kinds=["autoscale"], newest_first=True, limit=1))
    if ended is None:
        if now.state != "starting":
            st.info(f"vLLM is {now.state}: {now.reason}", icon=":material/autorenew:")
        return
    st.session_state.pop(f"applying{scope()}")
    view = now.startup if now.startup is not None and now.startup.revision == applying["revision"] else None
    st.session_state[f"apply_outcome{scope()}"] = (*ended, lines, view)
    st.session_state["clear_note"] = True
    st.rerun(scope="app")  # the whole page: state banner, form and history follow the new revision


def last_outcome() -> None:
    """How the latest apply of this session ended, with its timeline and the start's phases."""
    ended = st.session_state.get(f"apply_outcome{scope()}")
    if not ended:
        return
    kind, message, lines, view = ended
    (st.success if kind == "success" else st.error)(message, icon=":material/check:" if kind == "success"
                                                     else ":material/undo:")
    with kept_expander("Timeline of the restart", f"timeline{scope()}_{zlib.crc32(message.encode())}"):
        st.markdown("\n".join(f"- {line}" for line in lines))
        if view is not None:
            phases(view)
