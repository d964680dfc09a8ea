"""LoRA adapters on the session's engine and its real vLLM (CPU build, LoRA on: tests/conftest.py): a bad adapter is
refused naming the reason and nothing changes; the demo adapter (data/models/demo-lora, trained offline) is
registered while clients stream — in effect without a restart, no request failed — and answers the same prompt
differently from the base model at temperature 0. That an apply keeps it is proven by the apply journey
(test_session_engine.py), whose clients call it throughout."""

from __future__ import annotations

import httpx

from tests.testkit.adapters import make_adapter
from tests.testkit.engine import COLD_START_S, EngineHandle, ensure_demo_lora
from tests.testkit.load import Load, summary
from tests.testkit.wait import wait_until

ADAPTER = "demo-lora"
PROMPTS = ("The function returns", "This module provides", "If the file does not exist,")


def register_demo_adapter(engine: EngineHandle) -> None:
    """The demo adapter under the default deployment (once: a later journey finds it there)."""
    if ADAPTER not in {a.name for a in engine.client.adapters("demo")}:
        engine.client.register_adapter("demo", ADAPTER, str(ensure_demo_lora()))


def answer(engine: EngineHandle, model: str, prompt: str) -> str:
    resp = httpx.post(f"{engine.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def test_an_adapter_registered_under_streaming_load_answers_differently_with_no_restart(
        engine: EngineHandle) -> None:
    c = engine.client
    c.wait_for({"ready"}, COLD_START_S)
    if ADAPTER in {a.name for a in c.adapters("demo")}:
        c.remove_adapter("demo", ADAPTER)
    # bad adapters: refused with the reason, nothing registered, nothing restarted
    models = engine.data_dir / "models"
    make_adapter(models / "rank-16", rank=16)
    make_adapter(models / "gpt2-style", targets=("c_attn",))
    for path, why in ((models / "rank-16", "above the deployment's max_lora_rank 8"),
                      (models / "gpt2-style", "c_attn are not modules of the base model")):
        resp = httpx.post(f"{engine.url}/api/deployments/demo/adapters", headers=engine.auth, timeout=60,
                          json={"name": "bad", "path": str(path)})
        assert resp.status_code == 422 and why in resp.text, resp.text
    assert c.adapters("demo") == []
    before = c.status()
    marker = c.events(limit=1, newest_first=True)[0].id

    base = Load(engine.url, clients=2, stream=True, pause_s=0.2).start()
    base.wait_for(4, timeout=120)
    register_demo_adapter(engine)
    tuned = Load(engine.url, clients=2, stream=True, pause_s=0.2, model=ADAPTER).start()
    tuned.wait_for(6, timeout=120)
    outcomes = base.stop() + tuned.stop()
    counts = summary(outcomes)
    assert counts["ok"] == counts["total"], (counts, [o for o in outcomes if not o.ok][:3])

    after = c.status()
    assert after.pid == before.pid and not c.events(kinds=["starting"], since=marker)  # no restart
    adapter = next(a for a in c.adapters("demo") if a.name == ADAPTER)
    assert adapter.listed and adapter.rank == 8 and adapter.base == "demo"
    assert adapter.loaded_on == [i.name for i in after.instances]
    listed = httpx.get(f"{engine.url}/v1/models", timeout=30).json()["data"]
    assert {"id": ADAPTER, "parent": "demo"}.items() <= next(m for m in listed if m["id"] == ADAPTER).items()
    # the same prompts, temperature 0: the fine-tune answers otherwise than its base
    pairs = [(answer(engine, "demo", p), answer(engine, ADAPTER, p)) for p in PROMPTS]
    assert all(b != t for b, t in pairs), pairs
    wait_until(lambda: next(a for a in c.adapters("demo") if a.name == ADAPTER).requests_24h >= 6 + len(PROMPTS),
               30, what="the adapter's requests in the ledger")
