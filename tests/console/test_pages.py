"""Every console page, run with streamlit.testing.v1.AppTest against the engine app in this process (its real API,
store and serving controller, fake vLLM children beneath: tests/testkit/console.py): what a person sees and does on
each page, no engine process and no vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from engine.client import EngineClient, Run, route_through
from engine.db import BenchmarkRun
from engine.schemas import DeploymentOut
from engine.vllm import free_port
from tests.testkit.console import ADMIN_PASSWORD, InProcessEngine, in_process_engine
from tests.testkit.wait import wait_until

EngineHandle = InProcessEngine


@pytest.fixture(scope="module")
def engine_here(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessEngine]:
    with in_process_engine(tmp_path_factory.mktemp("console")) as engine:
        yield engine


@pytest.fixture
def console_env(engine_here: InProcessEngine) -> Iterator[InProcessEngine]:
    # (an engine of a test of its own, made after this one and gone, takes the route with it: the pages'
    # clients reach this one again)
    route_through(engine_here.transport)
    engine_here.client.wait_for({"ready"}, 60)
    wait_until(lambda: engine_here.client.serving().available, 30,  # the first scrape of /metrics after a start
               what="vLLM's first metrics scrape")
    yield engine_here


def page(name: str, token: str | None = None) -> AppTest:
    at = AppTest.from_file(f"../../pages/{name}.py", default_timeout=60)
    if token:
        at.session_state["token"] = token  # as the sign-in page leaves it
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(at: AppTest) -> str:
    return "\n".join([m.value for m in at.markdown] + [c.value for c in at.caption] + [e.value for e in at.error]
                     + [w.value for w in at.warning] + [i.value for i in at.info])


def test_overview_shows_state_model_serving_and_the_host(console_env: EngineHandle) -> None:
    at = page("overview", console_env.token)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["State"] == "ready"
    assert "Requests running" in metrics and "KV-cache use" in metrics
    body = texts(at)
    assert "demo" in body and "vLLM 0.32.0 (cpu)" in body
    assert "No GPU: this host runs the CPU build of vLLM" in body and "not GPU numbers" in body


def test_gpu_health_is_honest_about_the_missing_gpu(console_env: EngineHandle) -> None:
    at = page("gpu_health", console_env.token)
    assert "NVML" in texts(at)
    assert len(at.get("plotly_chart")) == 2  # host CPU and memory over the window
    at.segmented_control(key="gpu_window").set_value("1 hour").run()
    assert not at.exception
    assert "4 s per point" in texts(at)  # an hour in at most ~1,000 points


def number(at: AppTest, label: str) -> Any:
    return next(n for n in at.number_input if n.label == label)


def test_settings_preview_follows_the_form_and_writes_nothing(console_env: EngineHandle) -> None:
    before = console_env.client.settings()
    at = page("settings", console_env.token)
    assert number(at, "max_num_seqs").value == before.values.max_num_seqs
    assert any(c.value.startswith("No edits") for c in at.caption)
    number(at, "max_num_seqs").set_value(before.values.max_num_seqs + 1).run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    seqs = before.values.max_num_seqs + 1
    pred = console_env.client.capacity({"max_num_seqs": seqs}).prediction
    assert pred is not None and metrics["KV tokens"][0].isdigit()
    # what runs at once: max_num_seqs when it is the tighter bound (the KV cache's figure alone overstated it 4-8x)
    if seqs < pred.max_concurrency:
        assert metrics["Concurrency"] == str(seqs)
    else:
        assert metrics["Concurrency"].endswith("x")
    assert len(at.dataframe) == 1  # the edits: max_num_seqs only
    assert list(at.dataframe[0].value["field"]) == ["max_num_seqs"]
    # the apply's ETA is its plan's steps, each timed (the start by the earlier starts of its kind), not one figure
    eta = next(c.value for c in at.caption if c.value.startswith("By plan "))
    assert "It should take about" in eta and "start " in eta and " + stop " in eta
    number(at, "cpu_kv_cache_gib (memory for the KV cache)").set_value(0.001).run()
    errors = "\n".join(e.value for e in at.error)
    assert "cpu_kv_cache_gib" in errors
    use = next(b for b in at.button if b.label.startswith("Use cpu_kv_cache_gib = "))
    fit = float(use.label.rsplit("=", 1)[1])
    use.click().run()  # the suggestion's "use this value"
    assert number(at, "cpu_kv_cache_gib (memory for the KV cache)").value == fit
    assert not any(b.label.startswith("Use cpu_kv_cache_gib") for b in at.button)
    assert console_env.client.settings().revision == before.revision


def test_max_num_seqs_headroom_is_a_field_and_its_error_offers_the_fix(console_env: EngineHandle) -> None:
    """The form had no field for max_num_seqs_ceiling: above it, an error with no fix, Apply enabled, a dialog
    blaming "the device or the model" and a refused confirm (issue 31). Now the ceiling is a field, a max_num_seqs
    above it offers the ceiling as a button, Apply is disabled until then, and a max_num_seqs change that restarts
    says a ceiling would avoid it."""
    before = console_env.client.settings()
    at = page("settings", console_env.token)
    ceiling = "max_num_seqs_ceiling (0 = max_num_seqs: no headroom)"
    assert number(at, ceiling).value == (before.values.max_num_seqs_ceiling or 0)
    seqs = before.values.max_num_seqs
    number(at, ceiling).set_value(seqs + 2).run()
    number(at, "max_num_seqs").set_value(seqs + 4).run()  # above the ceiling just set
    assert not at.exception
    assert any("max_num_seqs_ceiling" in e.value for e in at.error)
    apply = next(b for b in at.button if b.label in ("Apply & restart", "Apply now"))
    assert apply.disabled  # nothing to confirm that the engine would refuse
    fix = next(b for b in at.button if b.label == f"Use max_num_seqs_ceiling = {seqs + 4}")
    fix.click().run()
    assert number(at, ceiling).value == seqs + 4
    assert not any("max_num_seqs_ceiling" in e.value for e in at.error)
    apply = next(b for b in at.button if b.label in ("Apply & restart", "Apply now"))
    assert not apply.disabled
    assert list(at.dataframe[0].value["field"]) == ["max_num_seqs", "max_num_seqs_ceiling"]
    assert console_env.client.settings().revision == before.revision  # nothing written


def test_a_colleague_s_revision_does_not_wipe_unsaved_edits_unseen(console_env: EngineHandle) -> None:
    """A colleague's apply silently wiped the edit one was making (issue 31): the form starts from the new revision,
    says whose it is, and offers the edits back."""
    before = console_env.client.settings()
    at = page("settings", console_env.token)
    mine = before.values.max_num_seqs + 3
    number(at, "max_num_seqs").set_value(mine).run()
    theirs = console_env.client.put_settings(before.revision, {"max_model_len": 1024}, "a colleague's change")
    at.run()
    assert not at.exception
    said = next(w.value for w in at.warning if "replaced revision" in w.value)
    assert f"Revision **{theirs.revision}**" in said and f"max_num_seqs = {mine}" in said
    assert number(at, "max_num_seqs").value == before.values.max_num_seqs  # the form is the new revision's
    next(b for b in at.button if b.label == "Put my edits back").click().run()
    assert number(at, "max_num_seqs").value == mine
    assert not any("replaced revision" in w.value for w in at.warning)
    assert list(at.dataframe[0].value["field"]) == ["max_num_seqs"]  # my edit, on top of their revision
    console_env.client.wait_for({"ready"}, 60, revision=theirs.revision)
    back = console_env.client.put_settings(theirs.revision, {"max_model_len": before.values.max_model_len},
                                           "test: as before")
    console_env.client.wait_for({"ready"}, 60, revision=back.revision)


def test_the_kpi_table_names_requests_no_revision_served(console_env: EngineHandle) -> None:
    """Requests refused before any revision served them showed as a revision `None` with 100 % errors (issue 31)."""
    refused = Run(model="no-such-model", mode="completion", prompt="x", params={"max_tokens": 1})
    assert list(console_env.client.stream(refused)) == [] and refused.error  # 404: no deployment serves it
    at = page("metrics", console_env.token)
    table = next(d for d in at.dataframe if "revision" in d.value.columns)
    revisions = [str(v) for v in table.value["revision"]]
    assert "none: refused" in revisions and "None" not in revisions, revisions


def test_playground_streams_a_reply_with_its_figures(console_env: EngineHandle) -> None:
    at = page("playground", console_env.token)
    at.text_area(key="pg_prompt").set_value("Describe what this module does.")
    at.number_input(key="pg_a_max_tokens").set_value(16)
    next(b for b in at.button if b.label == "Run").click().run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Output tokens"] not in ("n/a", "0")
    assert metrics["Finish"] in ("stop", "length")
    assert metrics["Time to first token"].endswith(("ms", "s"))


def places(at: AppTest) -> dict[str, tuple[int, ...]]:
    """Where each keyed widget and each button stands in the page's tree (its path of indexes): the browser keeps
    what stood at a place while a run draws, until that run puts something there."""
    found: dict[str, tuple[int, ...]] = {}

    def walk(node: Any, path: tuple[int, ...]) -> None:
        for index, child in getattr(node, "children", {}).items():
            here = (*path, index)
            name = getattr(child, "key", None) or (f"button {child.label}" if child.type == "button" else None)
            if name:
                found.setdefault(name, here)
            walk(child, here)

    walk(at.main, ())
    return found


def test_a_banner_that_comes_and_goes_moves_nothing_below_it(console_env: EngineHandle) -> None:
    """The restart banner (vLLM stopped, starting, asleep) is drawn or not above the page: while it came or went,
    everything below it moved by one, and the browser showed the last run's widgets below the new ones until the
    run ended (a deployment waking from zero: two Run buttons on the playground)."""
    at = page("playground", console_env.token)
    assert not at.warning and not at.info
    serving = places(at)
    console_env.client.engine_action("stop")
    try:
        console_env.client.wait_for({"stopped"}, 60)
        at.run()
        assert any("vLLM is stopped" in w.value for w in at.warning), [w.value for w in at.warning]
        stopped = places(at)
    finally:
        console_env.client.engine_action("start")
        console_env.client.wait_for({"ready"}, 60)
    assert stopped == serving, {k: (v, stopped.get(k)) for k, v in serving.items() if stopped.get(k) != v}


def test_a_click_while_the_page_is_still_drawn_after_arriving_is_not_undone(console_env: EngineHandle) -> None:
    """Coming back to a page restores its draft until one run of it has ended; a click that cut that run short
    (the page was still being drawn) changed a field the restore then put back: compare switched on, and off."""
    at = page("playground", console_env.token)
    at.number_input(key="pg_a_max_tokens").set_value(64).run()  # the draft: max_tokens 64, compare off
    at.session_state["_arrived"] = True  # the arrival's run was cut short: it stands
    at.toggle(key="pg_compare").set_value(True).run()  # the click that cut it
    assert not at.exception
    assert at.toggle(key="pg_compare").value is True
    assert at.number_input(key="pg_b_max_tokens")  # B's fields are drawn
    assert at.number_input(key="pg_a_max_tokens").value == 64
    assert at.session_state["_arrived"] is False  # drawn whole: from now on the fields are the user's

    saved = console_env.client.save_prompt("loaded on arrival", "chat", "", "Loaded while the page was drawn.", {})
    at.run()
    at.selectbox(key="saved_choice").set_value(f"loaded on arrival (chat) · by {saved.author}").run()
    at.text_area(key="pg_prompt").set_value("typed before").run()
    at.session_state["_arrived"] = True
    next(b for b in at.button if b.label == "Load").click().run()  # its callback sets the fields: not undone
    assert at.text_area(key="pg_prompt").value == "Loaded while the page was drawn."
    console_env.client.delete_prompt(saved.id)


def test_the_playground_keeps_its_fields_in_place_whichever_the_mode(console_env: EngineHandle) -> None:
    """A conversation that ends, compare switched on or off, a schema's error: what follows stays where it was.
    In the browser, while the next run drew, the last run's Run button stood below the new one (two Run buttons:
    CI's product-team journey after "New conversation"), and the single form's max_tokens (A's) stood where B's
    was about to be (48 typed there went to A)."""
    at = page("playground", console_env.token)
    at.segmented_control(key="pg_mode").set_value("chat").run()
    for fresh in (b for b in at.button if b.label == "New conversation"):  # (the session's draft may hold one)
        fresh.click().run()
    at.toggle(key="pg_compare").set_value(False)
    at.selectbox(key="pg_format").set_value("Text")
    at.text_area(key="pg_prompt").set_value("Describe what this module does.")
    at.number_input(key="pg_a_max_tokens").set_value(4)
    next(b for b in at.button if b.label == "Run").click().run()
    assert not at.exception and len(at.chat_message) == 2
    talking = places(at)
    next(b for b in at.button if b.label == "New conversation").click().run()
    assert len(at.chat_message) == 0
    quiet = places(at)
    at.toggle(key="pg_compare").set_value(True).run()
    comparing = places(at)
    at.selectbox(key="pg_format").set_value("JSON schema").run()
    at.text_area(key="pg_schema").set_value("{not json").run()
    assert at.error, "the schema's error is shown"
    wrong_schema = places(at)
    fields = ("pg_a_temperature", "pg_a_top_p", "pg_a_max_tokens", "pg_a_stop")
    for key in ("pg_prompt", *fields, "button Run"):
        assert talking[key] == quiet[key] == comparing[key] == wrong_schema[key], (
            key, talking[key], quiet[key], comparing[key], wrong_schema[key])
    # every place of the single form holds the same widget with compare on: nothing of it is left standing among
    # A's and B's fields while the page is drawn (the old layout's 4 columns became 2: its max_tokens stood on)
    at_place = {place: key for key, place in comparing.items()}
    assert all(at_place.get(place) == key for key, place in quiet.items()), {
        key: (place, at_place.get(place)) for key, place in quiet.items() if at_place.get(place) != key}


def test_saved_prompts_load_save_and_delete_at_once(console_env: EngineHandle) -> None:
    # saved as the playground saves them: "stop" empty is None (loading it raised AttributeError: 'NoneType' ...)
    saved = console_env.client.save_prompt("json answer", "chat", "Answer in JSON.", "What is a module?",
                                           {"temperature": 0.2, "max_tokens": 32, "stop": None, "top_p": 0.9})
    at = page("playground", console_env.token)
    choice = f"json answer (chat) · by {saved.author}"
    assert choice in at.selectbox(key="saved_choice").options
    at.selectbox(key="saved_choice").set_value(choice).run()
    next(b for b in at.button if b.label == "Load").click().run()
    assert not at.exception
    assert at.text_area(key="pg_prompt").value == "What is a module?"
    assert at.slider(key="pg_a_temperature").value == 0.2 and at.text_input(key="pg_a_stop").value == ""
    assert any(b.label == "Run" for b in at.button)
    at.text_input(key="pg_save_name").set_value("second copy").run()
    next(b for b in at.button if b.label == "Save").click().run()
    copy = f"second copy (chat) · by {saved.author}"
    assert copy in at.selectbox(key="saved_choice").options  # listed at once
    assert at.selectbox(key="saved_choice").value == copy
    next(b for b in at.button if b.label == "Delete").click().run()
    assert copy in at.selectbox(key="saved_choice").options  # not yet: it asks first, naming it and its author
    assert any(f"**second copy** (chat) by **{saved.author}**" in m.value for m in at.markdown)
    assert any(b.label == "Delete" for b in at.button if b.key == "pg_confirm_delete")  # the dialog's own
    # (the dialog's button reruns the dialog alone, as a fragment, which AppTest does not: the browser journey
    # deletes through it)
    for p in console_env.client.prompts():
        if p.name in ("json answer", "second copy"):
            console_env.client.delete_prompt(p.id)


def test_a_prompter_cannot_delete_a_prompt_someone_else_saved(console_env: EngineHandle) -> None:
    theirs = console_env.client.save_prompt("not yours", "chat", "", "Hello.", {})
    name = "pages-prompter"
    if name not in {u.username for u in console_env.client.users()}:
        console_env.client.create_user(name, "pages-prompter-password", "prompter")
    session = EngineClient(console_env.url).login(name, "pages-prompter-password")
    at = page("playground", session.token)
    at.selectbox(key="saved_choice").set_value(f"not yours (chat) · by {theirs.author}").run()
    assert next(b for b in at.button if b.label == "Delete").disabled
    console_env.client.delete_prompt(theirs.id)


def test_the_playground_draft_survives_a_reload(console_env: EngineHandle) -> None:
    """F5 starts a new Streamlit session: the draft comes back whole, from the console's server."""
    at = page("playground", console_env.token)
    at.text_area(key="pg_prompt").set_value("half a thought").run()
    at.number_input(key="pg_a_max_tokens").set_value(64).run()
    at.selectbox(key="pg_format").set_value("JSON object").run()
    at.toggle(key="pg_compare").set_value(True).run()
    at.number_input(key="pg_b_max_tokens").set_value(48).run()
    at.toggle(key="pg_compare").set_value(False).run()  # B's fields are hidden now, and kept
    again = page("playground", console_env.token)  # a reload: same sign-in, a new session
    assert again.text_area(key="pg_prompt").value == "half a thought"
    assert again.number_input(key="pg_a_max_tokens").value == 64
    assert again.selectbox(key="pg_format").value == "JSON object"
    assert again.toggle(key="pg_compare").value is False
    again.toggle(key="pg_compare").set_value(True).run()
    assert again.number_input(key="pg_b_max_tokens").value == 48
    with EngineClient(console_env.url) as admin:  # another sign-in (not on the session's shared client)
        other = page("playground", admin.login("admin", ADMIN_PASSWORD).token)
    assert other.text_area(key="pg_prompt").value == ""


def test_events_and_log_tail(console_env: EngineHandle) -> None:
    at = page("events", console_env.token)
    table = next(m.value for m in at.markdown if m.value.startswith("| severity | time | kind"))
    assert "**engine\\_started**" in table and "**ready**" in table  # every message whole, in a table that wraps
    assert any("non-default args" in c.value for c in at.code)
    at.multiselect(key="ev_groups").set_value(["Settings changes"]).run()
    assert not at.exception
    at.selectbox(key="log_level").set_value("error").run()
    again = page("events", console_env.token)  # a reload keeps the filters
    assert again.multiselect(key="ev_groups").value == ["Settings changes"]
    assert again.selectbox(key="log_level").value == "error"


def test_log_filters_the_browser_never_got_are_drawn_with_their_values(console_env: EngineHandle) -> None:
    """A run that starts drops what the last one had queued for the browser and not yet sent: fields it drew may
    never reach the browser (seen on a busy host: a click right after a reload). The next run, whose request
    carries no value for them, must still tell the browser their values, or it shows each widget's own first value
    (Last lines 20, Hide polling off) and sends that back with the next click: the log then showed 20 lines with
    the /health polling in it."""
    from streamlit.proto.WidgetStates_pb2 import WidgetStates

    at = page("events", console_env.token)
    at.selectbox(key="log_level").set_value("error").run()
    at.number_input(key="log_tail").set_value(1000).run()
    at._run(widget_state=WidgetStates())  # the request of a browser that never got the fields' deltas
    assert not at.exception

    def shown(key: str, kind: str) -> Any:
        """What a browser that did not have the widget shows: the value it is told, else the widget's own."""
        widget = getattr(at, kind)(key=key)
        return widget.proto.value if widget.proto.set_value else widget.proto.default

    assert shown("log_tail", "number_input") == 1000
    assert shown("log_hide_polling", "toggle") is True
    assert shown("log_follow", "toggle") is True
    assert at.selectbox(key="log_level").proto.set_value  # and "failures only", not the first option
    assert at.selectbox(key="log_level").value == "error"


def test_metrics_page_shows_history_and_kpis(console_env: EngineHandle) -> None:
    answer = console_env.http.post("/v1/completions", json={"model": "demo", "prompt": "Return", "max_tokens": 4})
    assert answer.status_code == 200
    at = page("metrics", console_env.token)
    assert len(at.get("plotly_chart")) == 6
    assert len(at.dataframe) == 1  # the KPI table: the request above is in it
    assert int(at.dataframe[0].value.requests.sum()) >= 1
    assert [m.label for m in at.metric] == ["Generation tokens/s", "Prompt tokens/s", "P95 inter-token latency",
                                       "Preemptions /s"]


def test_benchmarks_page_offers_presets_sweeps_and_the_search(console_env: EngineHandle) -> None:
    at = page("benchmarks", console_env.token)
    assert at.selectbox(key="bm_preset").options == ["Short chat", "Long-prompt RAG", "Batch summarise"]
    assert at.multiselect(key="srch_cands").value == [1, 4, 16]
    assert any(b.label == "Run benchmark" for b in at.button)


def test_benchmarks_page_shows_each_levels_seed_and_cache_hits_and_warns_of_a_cache_test(
        console_env: EngineHandle) -> None:
    """A finished sweep as the runner stores it (the real one, through vLLM's benchmark module: the system tier's
    tests/system/test_journeys.py): the same seed asked for twice, the second level served from the cache."""
    from engine.benchmarks.runs import cache_warning

    revision = console_env.client.status().running_revision

    def level(hit: float) -> dict[str, Any]:
        out: dict[str, Any] = {"concurrency": 1, "revision": revision, "input_len": 1024, "output_len": 64,
                               "seed": 777, "completed": 2, "output_throughput": 40.0, "p95_e2el_ms": 900.0,
                               "mean_ttft_ms": 120.0, "prefix_cache_hit_pct": hit, "prefix_cache_queries": 2048}
        if (warning := cache_warning(hit)) is not None:
            out["warnings"] = [warning]
        return out

    with console_env.services.db.session() as s:
        s.add(BenchmarkRun(kind="sweep", revision_id=revision, preset="rag", status="done", author="tests",
                           params={"concurrency": [1, 1], "num_prompts": 2, "seed": 777},
                           results=[level(0.0), level(93.8)], finished_at=__import__("time").time()))
    at = page("benchmarks", console_env.token)
    table = at.dataframe[0].value  # the newest run, expanded
    assert list(table["seed"]) == ["777", "777"]
    hits = list(table["prefix cache hits"])
    assert all(h.endswith(" %") for h in hits) and float(hits[1].split()[0]) > 20
    warnings = [w.value for w in at.warning]
    assert any(w.startswith("concurrency 1: prompts were served from the prefix cache: the figures are a cache test")
               for w in warnings)
    assert "Seed 777 was asked for: every level sent the same prompts." in texts(at)


def test_audit_page_answers_who_changed_what(console_env: EngineHandle) -> None:
    before = console_env.client.settings()  # a write of its own (vLLM restarts; the next test waits for it)
    written = console_env.client.put_settings(before.revision, {"max_num_seqs": before.values.max_num_seqs + 1},
                                              note="audit page test")
    at = page("audit", console_env.token)
    assert len(at.dataframe) == 1
    at.text_input(key="au_text").set_value("max_num_seqs").run()
    assert not at.exception
    assert "No settings change" not in texts(at)
    latest = next(e for e in at.expander if "settings." in e.label)  # newest first, after the refused counts
    assert latest.label.endswith(f"settings.write → revision {written.revision} of demo")
    assert f"Revision **{written.revision}** is now" in "\n".join(m.value for m in latest.markdown)


def test_audit_keys_a_revision_on_its_deployment_and_says_when_that_was_deleted(console_env: EngineHandle) -> None:
    """A revision is (deployment, number): the audit's "what happened next" of another deployment's write showed the
    default deployment's revision of that number, and a deleted deployment's its successor's (issue 31)."""
    model = console_env.client.settings().values.model
    made = console_env.client.create_deployment("audit-b", {"model": model}, note="audit page test")
    other = console_env.client.of("audit-b")
    written = other.put_settings(made.revision, {"max_num_seqs": 3}, "audit page test: on b")
    at = page("audit", console_env.token)
    at.text_input(key="au_text").set_value("max_num_seqs").run()
    assert not at.exception
    labels = [e.label for e in at.expander]
    entry = next((e for e in at.expander if e.label.endswith(f"→ revision {written.revision} of audit-b")), None)
    assert entry is not None, labels
    assert f"Revision **{written.revision}** is now" in "\n".join(m.value for m in entry.markdown)
    console_env.client.delete_deployment("audit-b", confirm="audit-b")
    wait_until(lambda: "audit-b" not in {d.name for d in console_env.client.deployments()}, 60, what="b deleted")
    at = page("audit", console_env.token)
    at.text_input(key="au_text").set_value("max_num_seqs").run()
    assert not at.exception
    entry = next(e for e in at.expander if e.label.endswith(f"→ revision {written.revision} of audit-b"))
    assert any("has been deleted since" in c.value for c in entry.caption), [c.value for c in entry.caption]


def test_access_page_creates_a_token_and_shows_it_once(console_env: EngineHandle) -> None:
    at = page("access", console_env.token)
    assert len(at.dataframe) == 3  # users, teams, tokens
    next(t for t in at.text_input if t.label == "Name (what it is for)").set_value("page test")
    next(b for b in at.button if b.label == "Create" and "new_token" in b.form_id).click().run()
    assert not at.exception
    shown = [c.value for c in at.code]
    assert len(shown) == 1 and shown[0].startswith("llmops_")
    with EngineClient(console_env.url, token=shown[0]) as viewer:
        assert viewer.status().state  # a working token, of the role chosen (viewer by default)
    at.run()
    assert not at.code  # shown once
    assert "page test" in [t.name for t in console_env.client.tokens()]


def test_an_admin_makes_a_team_and_a_key_in_it_with_limits_and_changes_them_on_the_access_page(
        console_env: EngineHandle) -> None:
    at = page("access", console_env.token)
    next(t for t in at.text_input if t.label == "Name" and t.key == "team_name").set_value("research")
    number_in = {n.key: n for n in at.number_input}
    number_in["nt_budget"].set_value(50_000)
    number_in["nt_weight"].set_value(2.0)
    next(b for b in at.button if b.label == "Create team").click().run()
    assert not at.exception, [e.value for e in at.exception]
    team = next(t for t in console_env.client.teams() if t.name == "research")
    assert team.token_budget == 50_000 and team.budget_period == "day" and team.weight == 2.0
    # a gateway key in the team, with tokens per minute of its own
    next(t for t in at.text_input if t.label == "Name (what it is for)").set_value("etl key")
    at.selectbox(key="t_role").set_value("prompter")
    next(sb for sb in at.selectbox if sb.label == "Kind").set_value("gateway")
    at.selectbox(key="t_team").set_value("research")
    at.number_input(key="nk_tpm").set_value(9000)
    next(b for b in at.button if b.label == "Create" and "new_token" in b.form_id).click().run()
    assert not at.exception, [e.value for e in at.exception]
    key = next(t for t in console_env.client.tokens() if t.name == "etl key")
    assert key.team == "research" and key.tokens_per_minute == 9000 and key.kind == "gateway"
    # its limits changed: the form opens with what it has, and saves what is changed
    at.run()
    at.selectbox(key="key_pick").set_value(next(t for t in at.selectbox(key="key_pick").options
                                                if "etl key" in t))
    at.run()
    assert at.number_input(key=f"ek_{key.id}_tpm").value == 9000
    at.number_input(key=f"ek_{key.id}_budget").set_value(1000)
    next(b for b in at.button if b.label == "Save key").click().run()
    assert not at.exception, [e.value for e in at.exception]
    changed = next(t for t in console_env.client.tokens() if t.id == key.id)
    assert changed.token_budget == 1000 and changed.tokens_per_minute == 9000 and changed.team == "research"
    # a wrong change is refused, saying which field
    at.number_input(key="nt_budget").set_value(0)
    next(t for t in at.text_input if t.key == "team_name").set_value("RESEARCH")
    next(b for b in at.button if b.label == "Create team").click().run()
    assert any("**Name**" in e.value and "exists" in e.value for e in at.error), [e.value for e in at.error]


def test_the_usage_page_shows_tokens_by_key_team_and_day_with_their_cost(console_env: EngineHandle) -> None:
    from engine.gateway import Record

    c = console_env.client
    if "billing" not in {t.name for t in c.teams()}:
        c.create_team("billing")
    key = c.create_token("usage-page key", "prompter", "gateway", team="billing")
    other = c.create_token("usage-page other", "prompter", "gateway")
    c.update_deployment("demo", price_input_per_1k=1.0, price_output_per_1k=3.0)
    services = console_env.services
    team_id = next(t.id for t in c.teams() if t.name == "billing")
    demo = next(d.id for d in c.deployments() if d.name == "demo")
    import time as clock

    for key_id, team, ins, outs in ((key.id, team_id, 1000, 2000), (key.id, team_id, 500, 0),
                                    (other.id, None, 100, 100)):
        services.ledger.record(Record(ts=clock.time(), revision_id=1, model="demo", endpoint="/v1/completions",
                                      stream=False, status=200, latency_s=0.1, client="t", input_tokens=ins,
                                      output_tokens=outs, key_id=key_id, team_id=team, deployment_id=demo))
    services.ledger.flush()
    at = page("usage", console_env.token)
    rows = at.dataframe[0].value
    mine = rows[rows["key"] == "usage-page key"].iloc[0]
    assert mine["prompt tokens"] == 1500 and mine["completion tokens"] == 2000 and mine["requests"] == 2
    assert mine["cost"] == pytest.approx(1.5 + 6.0)
    assert len(at.get("plotly_chart")) == 2 and len(at.get("download_button")) == 2
    at.segmented_control(key="usage_group").set_value("team").run()
    assert not at.exception
    rows = at.dataframe[0].value
    assert rows[rows["team"] == "billing"].iloc[0]["tokens"] == 3500
    at.segmented_control(key="usage_window").set_value("Today").run()
    assert not at.exception and at.dataframe[0].value["requests"].iloc[-1] >= 3  # the total row
    # the choice of grouping is kept when the person comes back to the page
    again = page("usage", console_env.token)
    assert again.segmented_control(key="usage_group").value in ("key", "team")


def test_an_expired_sign_in_asks_to_sign_in_again(console_env: EngineHandle) -> None:
    at = page("overview", "llmops_revoked-or-expired")
    assert any("sign in again" in w.value for w in at.warning)


@pytest.mark.parametrize("name", ["overview", "deployments", "gpu_health", "settings", "playground", "events",
                                  "metrics", "benchmarks", "audit", "access", "usage", "alerts"])
def test_unreachable_engine_is_a_message_not_a_traceback(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMOPS_ENGINE_URL", "http://127.0.0.1:9")
    monkeypatch.setattr("engine.client._TRANSPORT", None)  # the network, where no engine listens
    at = page(name, "llmops_any")
    assert any("The engine is unreachable" in e.value for e in at.error)


# --- deployments: the switcher, the Deployments page -------------------------------------------------------------

SECOND = "pages-b"


@pytest.fixture
def second(console_env: EngineHandle) -> Iterator[str]:
    """A second deployment of the demo model, disabled (its settings and pages, no vLLM start), removed after."""
    c = console_env.client
    if SECOND not in {d.name for d in c.deployments()}:
        c.create_deployment(SECOND, {"model": c.settings().values.model, "max_num_seqs": 3, "cpu_kv_cache_gib": 0.25},
                            enabled=False)
    yield SECOND
    if SECOND in {d.name for d in c.deployments()}:
        c.delete_deployment(SECOND, confirm=SECOND)


def page_at(name: str, token: str, deployment: str | None = None) -> AppTest:
    """A page opened at its address with ``?deployment=`` (a deep link, or a reload of one)."""
    at = AppTest.from_file(f"../../pages/{name}.py", default_timeout=60)
    at.session_state["token"] = token
    if deployment is not None:
        at.query_params["deployment"] = deployment
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_address_picks_the_deployment_the_settings_form_is_of(console_env: EngineHandle, second: str) -> None:
    default = console_env.client.settings()
    assert default.values.max_num_seqs != 3
    at = page_at("settings", console_env.token, second)
    assert number(at, "max_num_seqs").value == 3  # B's value, not the default deployment's
    assert f"Deployment **{second}**" in texts(at)
    history = [e.label for e in at.expander if e.label.startswith("**")]  # its revisions only
    assert len(history) == 1 and history[0].startswith(f"**{console_env.client.of(second).settings().revision}**")
    plain = page_at("settings", console_env.token)  # no parameter: the default deployment, as always
    assert number(plain, "max_num_seqs").value == default.values.max_num_seqs


def test_an_edit_of_one_deployments_form_never_shows_in_anothers(console_env: EngineHandle, second: str) -> None:
    default = console_env.client.settings()
    at = page_at("settings", console_env.token)
    number(at, "max_num_seqs").set_value(default.values.max_num_seqs + 5).run()
    at.query_params["deployment"] = second  # the switcher, in the same browser session
    at.run()
    assert not at.exception
    assert number(at, "max_num_seqs").value == 3
    assert any(c.value.startswith("No edits") for c in at.caption)
    at.query_params["deployment"] = next(d.name for d in console_env.client.deployments() if d.default)
    at.run()  # back on the default one
    # its own desired revision again (the form starts from it on every return, as after a page switch), not B's
    assert number(at, "max_num_seqs").value == default.values.max_num_seqs
    assert console_env.client.settings().revision == default.revision


def test_metrics_drafts_are_kept_per_deployment(console_env: EngineHandle, second: str) -> None:
    at = page_at("metrics", console_env.token)
    at.segmented_control(key="metrics_window").set_value("6 hours").run()
    at.query_params["deployment"] = second
    at.run()
    assert not at.exception
    assert at.segmented_control(key="metrics_window").value == "1 hour"  # B's own (none yet: the default)
    assert f"Deployment **{second}**" in texts(at)
    again = page_at("metrics", console_env.token)  # a reload of the default one's page
    assert again.segmented_control(key="metrics_window").value == "6 hours"


def test_an_unknown_deployment_in_the_address_is_said_and_the_default_shown(console_env: EngineHandle) -> None:
    for name in ("overview", "settings", "metrics", "events", "playground", "benchmarks"):
        at = page_at(name, console_env.token, "no-such-deployment")
        warning = "\n".join(w.value for w in at.warning)
        assert "There is no deployment named **no-such-deployment**" in warning, name
        assert "shows the default deployment, **demo**" in warning, name
    at = page_at("settings", console_env.token, "no-such-deployment")
    assert number(at, "max_num_seqs").value == console_env.client.settings().values.max_num_seqs


def test_deployments_page_creates_disables_and_deletes_after_confirmation(console_env: EngineHandle) -> None:
    c = console_env.client
    name = "pages-created"
    at = page("deployments", console_env.token)
    assert any(r.startswith("demo") for r in at.dataframe[0].value["name"])
    model = c.settings().values.model
    assert any(o.startswith(f"{model} (local") for o in at.selectbox(key="dep_model").options)  # /api/models
    # a bad name: the engine's own reason, shown at the field, nothing created
    at.text_input(key="dep_name").set_value("bad name!")
    at.toggle(key="dep_enabled").set_value(False)
    next(b for b in at.button if b.label == "Create").click().run()
    assert not at.exception
    assert any(e.value.startswith("**name**") for e in at.error), [e.value for e in at.error]
    assert name not in {d.name for d in c.deployments()}
    at.text_input(key="dep_name").set_value("demo")  # taken
    next(b for b in at.button if b.label == "Create").click().run()
    assert any("demo" in e.value for e in at.error), [e.value for e in at.error]
    at.text_input(key="dep_name").set_value(name)
    at.number_input(key="dep_seqs").set_value(2)
    next(b for b in at.button if b.label == "Create").click().run()
    assert not at.exception
    assert f"Created **{name}**" in "\n".join(s.value for s in at.success)
    row = next(d for d in c.deployments() if d.name == name)
    assert not row.enabled and c.of(name).settings().values.max_num_seqs == 2
    assert any(n.startswith(name) for n in at.dataframe[0].value["name"])  # listed at once
    # enable, then disable again
    at.button(key=f"dep_enable_{row.id}").click().run()
    assert next(d for d in c.deployments() if d.name == name).enabled
    assert "Enabled" in "\n".join(s.value for s in at.success)
    at.button(key=f"dep_disable_{row.id}").click().run()  # one click disabled it, the default one too (issue 31)
    assert next(d for d in c.deployments() if d.name == name).enabled  # not yet: it asks first
    assert any(f"Disabling **{name}**" in w.value and "503" in w.value for w in at.warning)
    at.button(key=f"dep_disable_cancel_{row.id}").click().run()
    assert next(d for d in c.deployments() if d.name == name).enabled and not at.warning
    at.button(key=f"dep_disable_{row.id}").click().run()
    at.button(key=f"dep_disable_go_{row.id}").click().run()
    assert not next(d for d in c.deployments() if d.name == name).enabled
    # delete: it says what goes, and wants the name typed
    assert at.button(key=f"dep_delete_{c.deployments()[0].id}").disabled  # the default one cannot go
    at.button(key=f"dep_delete_{row.id}").click().run()
    assert any(f"Deleting **{name}**" in w.value and "revision(s)" in w.value for w in at.warning)
    go = next(b for b in at.button if b.label == "Delete for good")
    assert go.disabled
    at.text_input(key=f"dep_confirm_{row.id}").set_value("pages-create").run()  # not quite its name
    assert next(b for b in at.button if b.label == "Delete for good").disabled
    at.text_input(key=f"dep_confirm_{row.id}").set_value(name).run()
    next(b for b in at.button if b.label == "Delete for good").click().run()
    assert not at.exception
    assert f"Deleted **{name}**" in "\n".join(s.value for s in at.success)
    assert name not in {d.name for d in c.deployments()}
    assert not any(n.startswith(name) for n in at.dataframe[0].value["name"])



def test_clicks_and_what_they_said_stand_while_the_deployments_change_under_the_page(
        console_env: EngineHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page follows the deployments' list on a timer, drawing itself again when it moved. It also did so inline,
    in the run that carried a click, whenever the list had moved since the page's own read a moment before: the
    rerun dropped the click ("Disable now" did nothing while a deployment was starting; a console test under load)
    or what the action said. Here the list moves at every read: each click still does what it says."""
    c = console_env.client
    name = "pages-moving"
    row = c.create_deployment(name, {"model": c.settings().values.model, "max_num_seqs": 2}, enabled=False)
    try:
        at = page("deployments", console_env.token)
        real = EngineClient.deployments
        calls = 0

        def moving(self: EngineClient) -> list[DeploymentOut]:
            nonlocal calls
            calls += 1
            return [r.model_copy(update={"serving": r.serving + calls}) if r.name == name else r for r in real(self)]

        monkeypatch.setattr(EngineClient, "deployments", moving)
        at.button(key=f"dep_enable_{row.id}").click().run()
        assert not at.exception
        assert next(d for d in c.deployments() if d.name == name).enabled
        assert f"Enabled **{name}**" in "\n".join(s.value for s in at.success)
        at.button(key=f"dep_disable_{row.id}").click().run()
        assert any(f"Disabling **{name}**" in w.value for w in at.warning), [w.value for w in at.warning]
        at.button(key=f"dep_disable_go_{row.id}").click().run()
        assert not at.exception
        assert not next(d for d in c.deployments() if d.name == name).enabled
        assert f"Disabled **{name}**" in "\n".join(s.value for s in at.success)
    finally:
        monkeypatch.undo()
        c.delete_deployment(name, confirm=name)


def test_the_overview_sends_clients_to_the_gateway_workers_when_the_engine_has_them(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    port = free_port()
    with in_process_engine(tmp_path_factory.mktemp("workers"), gateway_workers=1, gateway_port=port) as engine:
        engine.client.wait_for({"ready"}, 60)
        wait_until(lambda: engine.client.gateway().workers[0].alive, 30, what="the gateway worker")
        at = page("overview", engine.token)
        body = texts(at)
        assert f"OpenAI-compatible API at **`http://127.0.0.1:{port}/v1`**" in body
        assert "Served by 1 of 1 gateway workers" in body
        assert any(f"http://127.0.0.1:{port}/v1/chat/completions" in c.value for c in at.code)


def test_the_metrics_page_draws_each_instance_over_time_when_a_deployment_has_two(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 32 item 2: per instance, over time — requests routed to each, the share by prefix, vLLM's prefix-cache
    hits and KV use, one line per instance."""
    import json

    from console.charts import bands

    with in_process_engine(tmp_path_factory.mktemp("two")) as engine:
        engine.client.wait_for({"ready"}, 60)
        base = engine.client.settings().revision
        engine.client.put_settings(base, {"replicas": 2}, "two instances")
        wait_until(lambda: len([i for i in engine.client.status().instances if i.serving]) == 2, 60,
                   what="two instances serving")
        system = "You are a careful assistant who answers in one word. " * 8  # whole blocks after the first

        def served() -> bool:  # 12 prompts whose first block differs: their homes spread them over both
            for n in range(12):
                prompt = f"Question {n:03d} of the quiz. " + system
                answer = engine.http.post("/v1/completions", json={"model": "demo", "max_tokens": 2, "prompt": prompt})
                assert answer.status_code == 200
            history = engine.client.instance_history("15m")
            return len(history.series) == 2 and all(
                any(bands(s)["requests_per_s"].avg) for s in history.series.values())

        wait_until(served, 30, every=0.5, what="both instances in the instance history")
        at = page("metrics", engine.token)
        body = texts(at)
        assert "Instances: routing and prefix cache" in body and "one line per instance" in body
        figures = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
        by_title = {f["layout"]["title"]["text"]: f for f in figures}
        routed = by_title["Requests routed to each instance"]
        names = [trace["name"] for trace in routed["data"]]
        assert len(names) == 2 and all(n.startswith("instance ") for n in names), names
        assert "Share routed by prefix" in by_title and "vLLM's prefix-cache hit rate" in by_title


def test_an_operator_turns_scale_to_zero_on_and_the_overview_says_what_the_next_request_meets(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 33: the form's autoscaling fields are applied without a restart; once idle, the deployment is scaled
    to zero and the Overview says so (not "stopped: requests get 503"); the next request is answered."""
    with in_process_engine(tmp_path_factory.mktemp("zero")) as engine:
        engine.client.wait_for({"ready"}, 60)
        at = page("settings", engine.token)
        number(at, "max_replicas (0 = no autoscaling)").set_value(2).run()
        number(at, "scale_to_zero_after_s (0 = never)").set_value(5.0).run()
        assert not at.exception
        assert list(at.dataframe[0].value["field"]) == ["max_replicas", "scale_to_zero_after_s"]
        assert next(b for b in at.button if b.label in ("Apply & restart", "Apply now")).label == "Apply now"
        before = engine.client.settings()
        engine.client.put_settings(before.revision, {"max_replicas": 2, "scale_to_zero_after_s": 5.0}, "idle to 0")
        # a served name of its own (not the deployment's): asleep, it must still reach the deployment (it did not:
        # GET /v1/models and the gateway knew only the names of instances that serve, and answered 404)
        named = engine.client.put_settings(engine.client.settings().revision, {"served_model_name": "demo-chat"},
                                           "a name of its own")
        wait_until(lambda: engine.client.status().running_revision == named.revision, 60, what="the new name")
        at = page("settings", engine.token)  # saved, then loaded: the form shows what was applied
        assert number(at, "max_replicas (0 = no autoscaling)").value == 2
        assert number(at, "scale_to_zero_after_s (0 = never)").value == 5.0
        wait_until(lambda: (s := engine.client.status()).autoscale is not None and s.autoscale.asleep
                   and not s.instances, 60, what="the deployment scaled to zero")
        at = page("overview", engine.token)
        body = texts(at)
        assert "Scaled to zero: no request for" in body and "Requests get 503" not in body
        assert "a cold start" in body and "waits in the gateway's queue" in body
        assert {m.label: m.value for m in at.metric}["Replicas wanted"] == "0 (asleep)"
        from console.charts import bands

        def recorded_asleep() -> bool:  # the scaling history is written with nothing to scrape too
            series = list(engine.client.scaling_history("15m").series.values())
            return bool(series) and 0 in bands(series[0])["replicas_wanted"].min
        wait_until(recorded_asleep, 30, what="the scaling history while asleep")
        at = page("metrics", engine.token)
        chart = next(json.loads(c.proto.spec) for c in at.get("plotly_chart")
                     if "Replicas against load" in c.proto.spec)
        assert {t["name"] for t in chart["data"]} == {"load (in flight and waiting)", "replicas wanted",
                                                     "replicas serving"}
        listed = engine.http.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["demo-chat"]  # asleep, listed: a request for it wakes it
        answer = engine.http.post("/v1/completions", json={"model": "demo-chat", "max_tokens": 2, "prompt": "hi"})
        assert answer.status_code == 200, answer.text
        status = engine.client.status()
        assert status.state == "ready" and status.autoscale is not None and not status.autoscale.asleep
        assert [e.data["action"] for e in engine.client.events(kinds=["autoscale"])] == ["to_zero", "wake"]


def test_the_alerts_page_lists_rules_sends_a_test_and_shows_what_fired(console_env: EngineHandle) -> None:
    from tests.testkit.receiver import receiver

    with receiver() as hook:
        at = page("alerts", console_env.token)
        assert not at.error, [e.value for e in at.error]
        next(t for t in at.text_input if t.key == "ch_name").set_value("pager")
        next(t for t in at.text_input if t.key == "ch_url").set_value(hook.url)
        next(b for b in at.button if b.label == "Add channel").click().run()
        assert not at.exception, [e.value for e in at.exception]
        channel = next(c for c in console_env.client.alert_channels() if c.name == "pager")
        assert channel.url.endswith("/…") and "s3cr3t" not in channel.url
        at.run()
        next(b for b in at.button if b.label == "Send a test message").click().run()
        assert any("answered 200" in s.value for s in at.success), [e.value for e in at.error]
        assert hook.bodies and hook.bodies[-1]["text"].startswith(":bell: TEST")
        # a rule switched off from the page
        box = at.selectbox(key="rule_pick")
        box.select_index(list(box.options).index("Crash loop")).run()
        crash = next(r for r in console_env.client.alert_rules() if r.name == "Crash loop")
        at.toggle(key=f"rule_on_{crash.id}").set_value(False)
        next(b for b in at.button if b.label == "Save rule").click().run()
        assert not at.exception
        assert not next(r for r in console_env.client.alert_rules() if r.name == "Crash loop").enabled
        console_env.client.update_alert_rule(crash.id, enabled=True)
        shown = [list(d.value["rule"]) for d in at.dataframe if "watches" in d.value.columns]
        assert shown and "Crash loop" in shown[0]


def test_an_operator_registers_a_lora_adapter_and_compares_it_with_its_base_in_the_playground(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 35: a bad folder is refused naming the reason; a good one registered on the Deployments page is listed
    with where it is loaded; the Playground offers it beside its base and runs both side by side."""
    from tests.testkit.adapters import give_demo_weights, make_adapter

    with in_process_engine(tmp_path_factory.mktemp("lora")) as engine:
        engine.client.wait_for({"ready"}, 60)
        data = engine.services.config.data_dir
        give_demo_weights(data / "models" / "demo")
        make_adapter(data / "models" / "tuned")
        make_adapter(data / "models" / "too-big", rank=64)
        rev = engine.client.put_settings(engine.client.settings().revision, {"enable_lora": True}, "LoRA on")
        wait_until(lambda: engine.client.status().running_revision == rev.revision, 60, what="LoRA on")
        at = page("deployments", engine.token)
        assert "No adapter is registered under **demo**" in texts(at)
        at.text_input(key="lora_name").set_value("big")
        at.text_input(key="lora_path").set_value("models/too-big")
        next(b for b in at.button if b.label == "Register").click().run()
        assert any("**path**" in e.value and "max_lora_rank 16" in e.value for e in at.error), texts(at)
        assert engine.client.adapters("demo") == []
        at.text_input(key="lora_name").set_value("tuned")
        at.text_input(key="lora_path").set_value("models/tuned")
        next(b for b in at.button if b.label == "Register").click().run()
        assert not at.exception
        assert any("Registered **tuned** (rank 8) under demo: loaded on" in s.value for s in at.success), texts(at)
        table = next(d.value for d in at.dataframe if "adapter" in d.value.columns)
        assert list(table["adapter"]) == ["tuned"] and list(table["rank"]) == [8]
        assert at.text_input(key="lora_name").value == ""  # the form is new for the next one

        at = page("playground", engine.token)
        assert at.selectbox(key="pg_model").options == ["demo", "tuned (LoRA adapter of demo)"]
        at.toggle(key="pg_compare_deps").set_value(True).run()
        assert at.selectbox(key="pg_dep_a").value == "demo" and at.selectbox(key="pg_dep_b").value == "tuned"
        at.text_area(key="pg_prompt").set_value("Describe what this module does.")
        at.number_input(key="pg_a_max_tokens").set_value(4)
        next(b for b in at.button if b.label == "Run").click().run()
        assert not at.exception
        shown = texts(at)
        assert "**A** · model **demo**" in shown and "**B** · model **tuned (LoRA adapter of demo)**" in shown, shown
        assert "tuned" in engine.placement.live()[0].served.models  # the adapter itself answered B
