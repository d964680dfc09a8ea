"""The console's drafts store: per sign-in session and page, bounded in sessions and in size."""

from __future__ import annotations

from console.drafts import Drafts


def test_a_draft_is_kept_per_session_and_page() -> None:
    store = Drafts()
    store.put("s1", "playground", {"pg_prompt": "half a thought", "pg_a_max_tokens": 64})
    store.put("s1", "events", {"log_level": "error"})
    store.put("s2", "playground", {"pg_prompt": "someone else's"})
    assert store.get("s1", "playground") == {"pg_prompt": "half a thought", "pg_a_max_tokens": 64}
    assert store.get("s1", "events") == {"log_level": "error"}
    assert store.get("s2", "playground") == {"pg_prompt": "someone else's"}
    assert store.get("s3", "playground") == {}
    store.forget("s1")  # a sign-out
    assert store.get("s1", "playground") == {}


def test_the_least_recently_used_session_goes_first_when_full() -> None:
    store = Drafts(max_sessions=2)
    store.put("old", "p", {"k": 1})
    store.put("mid", "p", {"k": 2})
    store.get("old", "p")  # used again: now "mid" is the least recent
    store.put("new", "p", {"k": 3})
    assert store.get("mid", "p") == {} and store.get("old", "p") == {"k": 1} and store.get("new", "p") == {"k": 3}


def test_a_field_past_the_size_bound_keeps_its_earlier_value() -> None:
    store = Drafts(max_chars=1000)
    store.put("s", "playground", {"pg_prompt": "short", "pg_messages": []})
    store.put("s", "playground", {"pg_prompt": "x" * 5000, "pg_messages": [{"role": "user", "content": "hi"}]})
    kept = store.get("s", "playground")
    assert kept["pg_prompt"] == "short" and kept["pg_messages"] == [{"role": "user", "content": "hi"}]
