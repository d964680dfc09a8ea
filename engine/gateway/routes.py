"""What the gateway forwards: vLLM's public OpenAI-compatible routes (and Anthropic's messages, Cohere/Jina
rerank and score), plus ``/tokenize`` and ``/detokenize``, which vLLM's benchmark uses. Nothing else of vLLM's
server is reachable through it: not its metrics, its docs, or its dev and admin routes (sleep, pause,
collective_rpc, LoRA loading, elastic scaling).

Paths are checked as sent (``raw_path``) and as decoded: dot-segments, empty segments, backslashes, encoded
slashes or dots and control characters are refused with 400, so a path can never mean one thing here and
another to vLLM; the path forwarded is the one matched, never the one sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (method, path); a {id} segment is one response id of /v1/responses.
ROUTES: tuple[tuple[str, str], ...] = (
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{id}"),
    ("POST", "/v1/responses/{id}/cancel"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"),
    ("POST", "/v1/score"),
    ("POST", "/v1/rerank"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
)
ROOT_PATHS = frozenset(p for _, p in ROUTES if not p.startswith("/v1/"))  # served beside /api, outside /v1
_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
_BAD_RAW = re.compile(rb"%(?:2[eEfF]|5[cC]|00)|[\x00-\x20\x7f\\]")
_EXACT: dict[str, set[str]] = {}
_WITH_ID: list[tuple[str, str, str]] = []  # (method, prefix, suffix)
for _method, _path in ROUTES:
    if "{id}" in _path:
        _prefix, _suffix = _path.split("{id}")
        _WITH_ID.append((_method, _prefix, _suffix))
    else:
        _EXACT.setdefault(_path, set()).add(_method)


@dataclass(frozen=True)
class PathRefusal:
    status: int  # 400 malformed, 404 not forwarded, 405 wrong method
    message: str
    allow: str = ""


def check_path(method: str, path: str, raw_path: bytes | None) -> str | PathRefusal:
    """The path to forward for this request, or why it is refused."""
    if raw_path is not None and _BAD_RAW.search(raw_path):
        return PathRefusal(400, "the path holds an encoded '.', '/', '\\' or NUL, or a control character: "
                           "send it plainly")
    segments = path.split("/")[1:]
    if any(s in (".", "..") for s in segments):
        return PathRefusal(400, "the path holds '.' or '..' segments: send the route itself")
    if "" in segments[:-1] or "\\" in path:
        return PathRefusal(400, "the path holds an empty segment ('//') or a backslash")
    if len(segments) > 1 and segments[-1] == "":
        path = path[:-1]  # /v1/models/ is /v1/models
    methods = _EXACT.get(path)
    if methods is None:
        for m, prefix, suffix in _WITH_ID:
            if path.startswith(prefix) and path.endswith(suffix) and _ID.fullmatch(
                    path[len(prefix):len(path) - len(suffix)] if suffix else path[len(prefix):]):
                methods = methods or set()
                methods.add(m)
    if not methods:
        return PathRefusal(404, f"{path[:200]} is not a route of this gateway: it forwards vLLM's OpenAI API "
                           "(/v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings, /v1/responses, "
                           "…) and /tokenize, /detokenize")
    if method not in methods:
        allow = ", ".join(sorted(methods))
        return PathRefusal(405, f"{method} is not allowed on {path}: use {allow}", allow)
    return path
