"""What the gateway learns from the requests and responses it passes: model, streaming, token usage, time to
first token. It asks vLLM for a final usage chunk on streams (``stream_options.include_usage``) and hides that
chunk from clients that did not ask for it."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

_CONTENT = re.compile(rb'"(?:content|text)":"[^"]')
USAGE_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class RequestInfo:
    model: str = ""
    stream: bool = False
    include_usage: bool = False
    data: dict[str, Any] | None = None

    @classmethod
    def parse(cls, body: bytes) -> RequestInfo:
        if not body:
            return cls()
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return cls()
        if not isinstance(data, dict):
            return cls()
        options = data.get("stream_options") or {}
        return cls(model=str(data.get("model", "")), stream=data.get("stream") is True,
                   include_usage=isinstance(options, dict) and bool(options.get("include_usage")), data=data)

    def prompt_text(self) -> str | None:
        """The prompt or messages as JSON, cut at 4,000 characters (only for sampled requests: it costs)."""
        prompt = self.data.get("messages", self.data.get("prompt")) if self.data is not None else None
        return None if prompt is None else json.dumps(prompt)[:4000]

    def body_with_usage(self) -> bytes | None:
        """The request asking vLLM for a final usage chunk, or None if it already does or cannot."""
        options = self.data.get("stream_options") if self.data is not None else None
        if self.data is None or not self.stream or self.include_usage or not isinstance(options, dict | None):
            return None  # a malformed stream_options is vLLM's to refuse
        return json.dumps({**self.data, "stream_options": {**(self.data.get("stream_options") or {}),
                                                           "include_usage": True}}).encode()


def usage_of(content: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a non-streamed OpenAI response."""
    try:
        usage = json.loads(content).get("usage") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None, None
    return usage.get("prompt_tokens"), usage.get("completion_tokens")


class StreamMeter:
    """Reads a server-sent-event stream as it passes: time to first content, chunks, the usage chunk."""

    def __init__(self, t0: float, hide_usage: bool) -> None:
        self.t0 = t0
        self.hide_usage = hide_usage
        self.ttft_s: float | None = None
        self.content_events = 0
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.error: str | None = None
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        """Take raw bytes; return those to send on (whole events, the hidden usage chunk left out)."""
        self._buffer += chunk
        out = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            if self._inspect(event):
                out.append(event + b"\n\n")
        return b"".join(out)

    def rest(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def _inspect(self, event: bytes) -> bool:
        if _CONTENT.search(event):
            self.content_events += 1
            if self.ttft_s is None:
                self.ttft_s = time.monotonic() - self.t0
        if b'"usage":{' in event:
            try:
                data = json.loads(event.split(b"data: ", 1)[1])
            except (IndexError, json.JSONDecodeError, UnicodeDecodeError):
                return True
            usage = data.get("usage") or {}
            self.input_tokens = usage.get("prompt_tokens", self.input_tokens)
            self.output_tokens = usage.get("completion_tokens", self.output_tokens)
            if self.hide_usage and not data.get("choices"):
                return False
        elif b'"error"' in event and event.startswith(b"data: {\"error\""):
            self.error = "stream error"
        return True
