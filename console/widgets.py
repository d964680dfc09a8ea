"""Shared pieces of the console's pages: the engine client, the engine's state, GPU and host cards."""

from __future__ import annotations

import json
import os
from typing import NoReturn
from urllib.parse import urlencode, urlsplit

import streamlit as st
from streamlit.delta_generator import DeltaGenerator
from streamlit.runtime.scriptrunner import get_script_run_ctx

from console import deployment, drafts, fmt
from console.session import safe_next
from engine.client import ClientError, EngineClient, EngineUnreachableError, UnauthorizedError
from engine.schemas import DeploymentOut, EventOut, GpuView, HostReading, MeOut, StatusOut

STATE_BADGE = {"ready": ("green", ":material/check_circle:"), "starting": ("orange", ":material/hourglass_top:"),
               "draining": ("orange", ":material/hourglass_bottom:"), "stopping": ("orange", ":material/pending:"),
               "stopped": ("gray", ":material/stop_circle:"), "failed": ("red", ":material/error:")}


def base_client() -> EngineClient:
    """This browser session's client, carrying its sign-in token, acting on the default deployment."""
    c: EngineClient | None = st.session_state.get("_client")
    if c is None or c.token != st.session_state.get("token"):
        c = EngineClient(os.environ.get("LLMOPS_ENGINE_URL"), timeout=10.0, token=st.session_state.get("token"))
        st.session_state["_client"] = c
    return c


def own_rerun() -> bool:
    """Whether a fragment is running on its own (its timer), not inline in a run of the whole page. Only then may
    it draw the whole page again (``st.rerun(scope="app")``) because what it sees differs from what the page was
    drawn with: inline, the page was drawn a moment ago, and a rerun there would drop the click that run carries
    (a "Disable now" or "Cancel" pressed as a deployment changed state did nothing). Its next timed run sees the
    difference as well."""
    ctx = get_script_run_ctx()
    return ctx is not None and bool(ctx.fragment_ids_this_run)


def chosen() -> deployment.Choice:
    """The deployment this page acts on: the address's ?deployment= (or the one chosen before a page switch)."""
    return deployment.resolve(base_client())


def client() -> EngineClient:
    """This browser session's client, acting on the deployment chosen in the switcher (console/deployment.py)."""
    name = chosen().name
    return base_client() if name is None else base_client().of(name)


def deployment_header(what: str = "") -> deployment.Choice:
    """Under a page's title: which deployment its figures and actions are of (where there are several), and a
    clear word when the address names one the engine does not know."""
    choice = chosen()
    with st.container():  # always there, drawn or not: what follows keeps its place (see restart_banner)
        if choice.unknown is not None:
            st.warning(f"There is no deployment named **{choice.unknown}**: this page shows the default deployment, "
                       f"**{choice.default_name}**. Pick one in the sidebar, or see the Deployments page.",
                       icon=":material/search_off:")
        elif choice.name is not None or len(choice.rows) > 1:
            st.caption(f"Deployment **{choice.shown}**" + (" (the default)" if choice.name is None else "")
                       + (f" · {what}" if what else ""))
    return choice


def deployment_label(row: DeploymentOut) -> str:
    return f"{row.name} · {row.state}" + ("" if row.enabled else " (disabled)")


PAGES = "_pages"  # Session State: the frame's pages by script name (console/app.py), for links between them


def open_link(script: str, label: str, name: str, *, icon: str | None = None, help: str | None = None,
              where: DeltaGenerator | None = None) -> None:
    """A link to a page of the console acting on deployment ``name`` (its address carries ?deployment=)."""
    target = st.session_state.get(PAGES, {}).get(script)
    box = where if where is not None else st
    if target is not None:
        box.page_link(target, label=label, icon=icon, help=help, query_params={deployment.PARAM: name})
    else:  # a page run on its own (a test): a plain link to the same address
        box.markdown(f"[{label}](/{script}?{urlencode({deployment.PARAM: name})})", help=help)


def switcher() -> None:
    """The sidebar's deployment switcher (quiet while there is only the default deployment)."""
    choice = chosen()
    rows = choice.rows
    if len(rows) <= 1 and choice.name is None:
        return
    names = [r.name for r in rows]
    current = choice.shown if choice.shown in names else (names[0] if names else choice.shown)
    labels = {r.name: deployment_label(r) + (" · default" if r.default else "") for r in rows}
    key = f"_switch_{current}"  # a new widget when the choice changes elsewhere (a deep link, the Deployments page)

    def picked() -> None:
        deployment.choose(st.session_state.get(key))

    st.selectbox("Deployment", names, index=names.index(current) if current in names else 0, key=key,
                 format_func=lambda n: labels.get(n, n), on_change=picked,
                 help="the deployment the pages act on; kept in the address (?deployment=) for links and reloads")


def me() -> MeOut:
    """Who this session is signed in as (what console/app.py asked the engine, or asked now)."""
    cached = st.session_state.get("_me")
    token = st.session_state.get("token")
    if isinstance(cached, tuple) and cached[0] == token and isinstance(cached[1], MeOut):
        return cached[1]
    try:
        who = client().me()
    except ClientError as exc:
        unreachable(exc)
    st.session_state["_me"] = (token, who)
    return who


def sign_out() -> None:
    drafts.forget()
    for key in ("token", "_client", "_me", "username", "role", "expires_at"):
        st.session_state.pop(key, None)


def sign_in_url(why: str | None = None) -> str:
    """The console server's sign-in page, coming back to the page this browser is on."""
    parts = urlsplit(st.context.url or "/")
    here = safe_next(parts.path + (f"?{parts.query}" if parts.query else ""))
    return "/signin?" + urlencode({"next": here, **({"why": why} if why else {})})


def go_to(url: str, message: str) -> None:
    """Send the browser to another page of the console's server (the sign-in, the sign-out), with a link as well
    in case scripts are off. ``url`` is built by the console, never taken from input."""
    st.markdown(f"{message} [Continue]({url})")
    st.html(f"<script>window.location.assign({json.dumps(url)});</script>", unsafe_allow_javascript=True)


def sign_out_form() -> None:
    """The sidebar's *Sign out* where the browser holds the console's session cookie: a plain form, so the browser
    itself POSTs to the console's server (which ends the session at the engine, clears the cookie and answers with
    the sign-in page) with no rerun of this script and no script of the page in between (the sign-out takes no GET:
    a link or an image on another page must not sign anyone out)."""
    st.html('<form method="post" action="/signout" style="margin:0">'
            '<button type="submit" style="font-family:inherit;font-size:.875rem;color:inherit;cursor:pointer;'
            'background:transparent;border:1px solid rgba(128,128,128,.45);border-radius:.5rem;'
            'padding:.25rem .75rem;min-height:2.5rem;line-height:1.6">'
            '<span aria-hidden="true">&#x21AA;&nbsp;</span>Sign out</button></form>')


def unreachable(exc: ClientError) -> NoReturn:
    if isinstance(exc, UnauthorizedError):
        sign_out()
        st.warning("Your sign-in has expired or was revoked: sign in again.", icon=":material/lock:")
        go_to(sign_in_url("expired"), "")
    elif isinstance(exc, EngineUnreachableError):
        st.error(f"**The engine is unreachable.** {exc}\n\nStart it with `make run` (or `llmops engine`); this "
                 "page retries when you reload it.", icon=":material/cloud_off:")
    else:
        st.error(f"**The engine refused the request.** {exc}", icon=":material/error:")
    st.stop()


def engine_status() -> StatusOut:
    """The engine's status, or a clear message and the end of the page when it cannot be reached."""
    try:
        return client().status()
    except ClientError as exc:
        unreachable(exc)


SEVERITY_ICON = {"error": ":material/error:", "critical": ":material/dangerous:", "warning": ":material/warning:"}


def event_line(ev: EventOut) -> str:
    """One event as a line of the on-call views: its severity, time, kind and message."""
    return f"{SEVERITY_ICON.get(ev.severity, ':material/info:')} `{ev.ts:%H:%M:%S}` **{ev.kind}** {ev.message}"


def state_badge(status: StatusOut) -> None:
    color, icon = STATE_BADGE.get(status.state, ("gray", ":material/help:"))
    st.badge(status.state.upper(), color=color, icon=icon)  # type: ignore[arg-type]


def kept_expander(label: str, key: str) -> DeltaGenerator:
    """An expander that stays as the person left it, open or closed, when the page draws itself again with more or
    fewer elements above it or with a new label (a revision's status in it changes): a plain one is made anew
    then, closed. An operator opened a history entry during an apply; the page drew itself again when the apply
    ended, and the entry, with its rollback button, was gone. ``key``: the thing it shows, unique on the page.

    Its state comes through Session State, and ``expanded`` stays the same: Streamlit makes it part of the
    expander's identity, so opening it drew it anew, and whatever had been typed in it before that answer came was
    lost (a slow console: the refusal an operator typed a value for never came)."""
    st.session_state[key] = bool(st.session_state.get(f"{key}:open"))
    return st.expander(label, key=key, expanded=False, on_change=_kept, args=(key,))


def _kept(key: str) -> None:
    st.session_state[f"{key}:open"] = bool(st.session_state.get(key))


def restart_banner(status: StatusOut) -> None:
    """Say so when vLLM is not serving, and why. In a block that is always there, banner or not: while a run draws,
    the browser keeps what stood at each place of the page until the run puts something there, so a banner that
    came or went would move what follows by one and, until the run ends, show the last run's widgets below the new
    ones (two Run buttons on the playground)."""
    with st.container():
        _banner(status)


def _banner(status: StatusOut) -> None:
    if status.state == "ready":
        return
    if status.state in ("starting", "draining", "stopping"):
        st.info(f"vLLM is {status.state} ({status.reason}, {fmt.since(status.since)}). Requests wait in the "
                f"gateway's queue ({status.gateway.waiting} waiting now) and are served once it is ready.",
                icon=":material/autorenew:")
    elif status.state == "stopped" and status.enabled and status.autoscale is not None and status.autoscale.asleep:
        st.info(f"{status.reason[:1].upper()}{status.reason[1:]}. Requests wait in the gateway's queue meanwhile "
                "and are answered.", icon=":material/bedtime:")
    elif status.state == "stopped":
        st.warning(f"vLLM is stopped: {status.reason}. Requests get 503 until it is started.",
                   icon=":material/stop_circle:")
    else:
        st.error(f"vLLM has failed: {status.reason}" + (f" — {status.halted}" if status.halted else ""),
                 icon=":material/error:")


def asleep_text(status: StatusOut) -> str:
    """What the next request to a deployment scaled to zero meets."""
    a = status.autoscale
    if a is None or a.wake is None:
        return ""
    comes_back = "wakes it (vLLM's sleep mode: about a second)" if a.wake == "sleep" else \
        "starts it again: a cold start" + (f" of about {fmt.seconds(a.cold_start_s)}" if a.cold_start_s else "")
    return f"The next request {comes_back}; it waits in the gateway's queue meanwhile and is answered."


def autoscale_card(status: StatusOut) -> None:
    """Replicas against the load: what the autoscaler wants, why, and what holds it."""
    a = status.autoscale
    if a is None or not (a.autoscaled or a.scale_to_zero_after_s is not None):
        return
    with st.container(border=True):
        bounds = f"{a.min_replicas}–{a.max_replicas}" if a.autoscaled else f"{a.max_replicas} (fixed)"
        target = (f"up when a request waits over {fmt.seconds(a.target_queue_wait_s)} for a slot (waited "
                  f"{fmt.seconds(a.queue_wait_s)} lately)" if a.target_queue_wait_s is not None else
                  f"target {a.target_in_flight:g} in flight per replica")
        st.markdown(f"**Autoscaling** · replicas {bounds}, {target}"
                    + (f" · to zero after {fmt.seconds(a.scale_to_zero_after_s)} idle"
                       if a.scale_to_zero_after_s is not None else ""))
        c1, c2, c3, c4 = st.columns(4)
        c1.metric("Replicas wanted", "0 (asleep)" if a.asleep else str(a.wanted))
        c2.metric("Serving", str(a.serving))
        c3.metric("Load", f"{a.load:g}", help="requests in flight and waiting, averaged over the last 5 s")
        c4.metric("Idle", fmt.seconds(a.idle_s) if a.idle_s is not None else "—", help="since the last request")
        if a.held:  # nothing serves: it waits for room to come back (many models on one GPU); else at a bound
            st.warning(f"{'Not back yet' if a.serving == 0 else 'Not scaling up'}: {a.held}", icon=":material/block:")
        elif a.pending:
            st.caption(f"Scaling {a.pending}.")
        if a.asleep:
            st.caption(asleep_text(status))


def gpu_card(g: GpuView) -> None:
    v = g.values
    with st.container(border=True):
        st.markdown(f"**GPU {g.index} · {g.name}**")
        if g.lost:
            st.error(f"Lost: {g.error}")
            return
        used, total, vllm = v.get("mem_used"), v.get("mem_total"), v.get("vllm_mem")
        c1, c2, c3, c4 = st.columns(4)
        c1.metric("Memory", fmt.used_of(used, total), help="NVML used / total")
        c2.metric("vLLM's share", fmt.gib(vllm), help="GPU memory of the vLLM child's processes")
        c3.metric("Utilization", fmt.pct(v.get("util_gpu")))
        c4.metric("Power", f"{fmt.watts(v.get('power_w'))} / {fmt.watts(v.get('power_limit_w'))}",
                  help="draw / enforced limit")
        if used is not None and total:
            st.progress(min(1.0, used / total), text=f"memory {100 * used / total:.1f} % used")
        c1, c2, c3, c4 = st.columns(4)
        c1.metric("Temperature", fmt.celsius(v.get("temp_c")), help=f"memory {fmt.celsius(v.get('mem_temp_c'))}")
        c2.metric("SM clock", fmt.mhz(v.get("sm_clock_mhz")), help=f"memory clock {fmt.mhz(v.get('mem_clock_mhz'))}")
        errors = sum(x or 0 for x in g.ecc.values() if x) if g.ecc else 0
        c3.metric("ECC errors", str(errors), help=", ".join(f"{k}: {x}" for k, x in g.ecc.items()) or "n/a")
        throttle = ", ".join(r for r in g.throttle_reasons if r != "gpu_idle") or "none"
        c4.metric("Throttle", throttle if len(throttle) < 18 else throttle[:16] + "…", help=throttle)
        if g.unavailable:
            st.caption("Not available on this GPU: " + ", ".join(sorted(g.unavailable)))


def host_card(host: HostReading, reason: str | None) -> None:
    with st.container(border=True):
        st.markdown("**No GPU: this host runs the CPU build of vLLM**")
        st.caption(f"NVML says: {reason or 'no GPU'}. These are the host's figures, not GPU numbers.")
        c1, c2, c3, c4 = st.columns(4)
        c1.metric("CPU", fmt.pct(host.cpu_pct), help=f"{host.cpu_count} cores, load {host.load_1m:.2f}")
        c2.metric("Memory", fmt.used_of(host.mem_used, host.mem_total))
        c3.metric("vLLM resident memory", fmt.gib(host.vllm_rss, 2))
        c4.metric("vLLM CPU", fmt.pct(host.vllm_cpu_pct))
