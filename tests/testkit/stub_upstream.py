"""A stub upstream, for tests and benchmarks only (not a vLLM: no model, no tokenizer): an HTTP/1.1 server that answers
``/v1/completions`` and ``/v1/chat/completions`` as vLLM streams them — one server-sent event per token, a usage chunk,
``[DONE]`` — as fast as it can, or ``token_s`` apart; ``/v1/responses`` and ``/v1/messages`` in the shapes of vLLM's
Responses API and Anthropic Messages (their usage, their named events; 8 prompt tokens, 2 of them from the prefix cache
in Anthropic's count); ``/v1/embeddings`` (an embedding of 4 zeros), ``/v1/score`` and ``/v1/rerank`` for 8 prompt
tokens. It counts the requests it
holds at once (``peak``), so a test can prove a cap that several processes share; ``/health`` answers 200.

Run alone (a benchmark's upstream): ``python -m tests.testkit.stub_upstream --port P [--token-s S]``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email.utils
import json
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.vllm import free_port
from tests.testkit.wait import wait_until


class StubUpstream:
    """``vllm_shaped``: each event as vLLM 0.26–0.32 writes a completion's (its fields and size, ~235 bytes), the
    end as vLLM ends (the finishing event, the usage, ``[DONE]`` and the last chunk, each a write of its own), and
    with ``token_s`` every stream's events on one clock, as vLLM's decode steps send them (all streams at once)."""

    def __init__(self, token_s: float = 0.0, tokens: int = 16, vllm_shaped: bool = False) -> None:
        self.token_s = token_s
        self.tokens = tokens  # when a request asks for none
        self.vllm_shaped = vllm_shaped
        self.current = 0
        self.peak = 0
        self.served = 0
        self.prompts: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length) if length else b""
                if path == "/health" or method == "GET":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
                    continue
                await self._answer(path, json.loads(body or b"{}"), writer)
        finally:
            with contextlib.suppress(ConnectionError):
                writer.close()

    async def _answer(self, path: str, data: dict[str, object], writer: asyncio.StreamWriter) -> None:
        chat = path.endswith("/chat/completions")
        asked = data.get("max_tokens") or data.get("max_completion_tokens") or data.get("max_output_tokens") \
            or self.tokens
        n = int(asked) if isinstance(asked, int | float | str) else self.tokens
        prompt = data.get("messages", data.get("prompt"))
        self.prompts.append(json.dumps(prompt)[:200])
        self.current += 1
        self.peak = max(self.peak, self.current)
        try:
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
            if path in ("/v1/embeddings", "/v1/score", "/v1/rerank"):
                out = json.dumps({"object": "list", "data": [{"object": "embedding", "index": 0,
                                                              "embedding": [0.0] * 4}] if path == "/v1/embeddings"
                                  else [{"index": 0, "score": 0.5}],
                                  "usage": {"prompt_tokens": 8, "total_tokens": 8}}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(out)).encode() + b"\r\n\r\n" + out)
                return
            if path in ("/v1/responses", "/v1/messages"):
                await self._named_events(path, n, bool(data.get("stream")), writer)
                return
            if not data.get("stream"):
                text = " tok" * n
                choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
                    {"index": 0, "text": text}
                out = json.dumps({"id": "stub", "object": "chat.completion" if chat else "text_completion",
                                  "choices": [choice], "usage": usage}).encode()
                if self.token_s:
                    await asyncio.sleep(self.token_s * n)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(out)).encode() + b"\r\n\r\n" + out)
                return
            if self.vllm_shaped:
                await self._vllm_stream(chat, n, usage, writer)
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            kind = b"chat.completion.chunk" if chat else b"text_completion"
            event = (b'data: {"id":"stub","object":"' + kind + b'","choices":[{"index":0,'
                     + (b'"delta":{"content":" tok"}' if chat else b'"text":" tok"') + b"}]}\n\n")
            chunk = f"{len(event):x}\r\n".encode() + event + b"\r\n"
            for _ in range(n):
                writer.write(chunk)
                if self.token_s:
                    await asyncio.sleep(self.token_s)
                else:
                    await writer.drain()
            tail = (b'data: {"id":"stub","object":"' + kind + b'","choices":[],"usage":' + json.dumps(usage).encode()
                    + b"}\n\ndata: [DONE]\n\n")
            writer.write(f"{len(tail):x}\r\n".encode() + tail + b"\r\n0\r\n\r\n")
            await writer.drain()
        finally:
            self.current -= 1
            self.served += 1

    async def _named_events(self, path: str, n: int, stream: bool, writer: asyncio.StreamWriter) -> None:
        """The Responses API's and Anthropic Messages' answers, as vLLM writes them."""
        text = " tok" * n
        if path == "/v1/responses":
            usage: dict[str, object] = {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 0},
                                        "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                                        "total_tokens": 8 + n}
            whole: dict[str, object] = {
                "id": "resp_stub", "object": "response", "status": "completed", "usage": usage,
                "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                                  "text": text}]}]}
            events: list[tuple[str, dict[str, object]]] = [
                ("response.created", {"type": "response.created", "response": {**whole, "status":
                                                                                    "in_progress", "usage": None}})]
            events += [("response.output_text.delta", {"type": "response.output_text.delta", "delta": " tok"})] * n
            events.append(("response.completed", {"type": "response.completed", "response": whole}))
        else:
            usage = {"input_tokens": 6, "cache_read_input_tokens": 2, "output_tokens": n}
            whole = {"id": "msg_stub", "type": "message", "role": "assistant", "usage": usage,
                     "content": [{"type": "text", "text": text}]}
            events = [("message_start", {"type": "message_start", "message": {**whole, "content": [], "usage": {
                **usage, "output_tokens": 0}}}), ("content_block_start", {"type": "content_block_start",
                                                                           "index": 0, "content_block": {
                                                                               "type": "text", "text": ""}})]
            events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": " tok"}})] * n
            events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                       ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                          "usage": usage}), ("message_stop", {"type": "message_stop"})]
        if not stream:
            out = json.dumps(whole).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(out)).encode() + b"\r\n\r\n" + out)
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for name, data in events:
            event = f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()  # (pydantic's)
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            if self.token_s:
                await asyncio.sleep(self.token_s)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _vllm_stream(self, chat: bool, n: int, usage: dict[str, int], writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{random.getrandbits(64):016x}"
        created = int(time.time())
        start = (f'data: {{"id":"{rid}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
                 f'"created":{created},"model":"bench","choices":[{{"index":0,').encode()
        writer.write(b"HTTP/1.1 200 OK\r\ndate: " + email.utils.formatdate(usegmt=True).encode()
                     + b"\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")

        def chunk(event: bytes) -> bytes:
            return b"%x\r\n%b\r\n" % (len(event), event)

        def token(text: str, finish: str | None) -> bytes:
            reason = b"null" if finish is None else b'"' + finish.encode() + b'"'
            if chat:
                return chunk(start + b'"delta":{"content":"' + text.encode() + b'"},"logprobs":null,'
                             b'"finish_reason":' + reason + b',"token_ids":null}]}\n\n')
            return chunk(start + b'"text":"' + text.encode() + b'","logprobs":null,"finish_reason":' + reason
                         + b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n')

        tick = int(loop.time() / self.token_s) if self.token_s else 0
        for i in range(n):
            if self.token_s:  # the next tick of one clock for every stream: vLLM's decode step
                tick = max(tick + 1, int(loop.time() / self.token_s) + 1)
                await asyncio.sleep(tick * self.token_s - loop.time())
            writer.write(token(random.choice(_WORDS), "length" if i == n - 1 else None))
            if not self.token_s:
                await writer.drain()
        writer.write(chunk(start.split(b',"choices"')[0] + b',"choices":[],"usage":' + json.dumps(usage).encode()
                           + b"}\n\n"))
        writer.write(chunk(b"data: [DONE]\n\n"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()


_WORDS = [" the", " of", "ched", ",", " se", "able", " The", ".", "-", " model", " token", " stream"]


@contextmanager
def stub_upstream(token_s: float = 0.0) -> Iterator[tuple[StubUpstream, str]]:
    """A stub upstream on a free port, in a thread of its own, until the block ends: it and its URL."""
    stub = StubUpstream(token_s)
    port = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    server: list[asyncio.base_events.Server] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        server.append(loop.run_until_complete(asyncio.start_server(stub.handle, "127.0.0.1", port)))
        ready.set()
        loop.run_forever()
        server[0].close()  # then its connections' handlers end while the loop still runs them
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(ready.is_set, 10, what="the stub upstream")
    try:
        yield stub, f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description="A stub upstream that streams as vLLM does, as fast as it can.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-s", type=float, default=0.0)
    parser.add_argument("--vllm-shaped", action="store_true", help="events, their end and their timing as vLLM's")
    args = parser.parse_args()

    async def serve() -> None:
        server = await asyncio.start_server(StubUpstream(args.token_s, vllm_shaped=args.vllm_shaped).handle,
                                            "127.0.0.1", args.port, backlog=4096)
        await server.serve_forever()

    import uvloop

    uvloop.run(serve())


if __name__ == "__main__":
    main()
