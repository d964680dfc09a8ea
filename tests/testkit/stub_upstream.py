"""A stub upstream, for tests and benchmarks only (not a vLLM: no model, no tokenizer): an HTTP/1.1 server that
answers ``/v1/completions`` and ``/v1/chat/completions`` as vLLM streams them — one server-sent event per token,
a usage chunk, ``[DONE]`` — as fast as it can, or ``token_s`` apart. It counts the requests it holds at once
(``peak``), so a test can prove a cap that several processes share; ``/health`` answers 200.

Run alone (a benchmark's upstream): ``python -m tests.testkit.stub_upstream --port P [--token-s S]``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from engine.vllm import free_port
from tests.testkit.wait import wait_until


class StubUpstream:
    def __init__(self, token_s: float = 0.0, tokens: int = 16) -> None:
        self.token_s = token_s
        self.tokens = tokens  # when a request asks for none
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
        asked = data.get("max_tokens") or data.get("max_completion_tokens") or self.tokens
        n = int(asked) if isinstance(asked, int | float | str) else self.tokens
        prompt = data.get("messages", data.get("prompt"))
        self.prompts.append(json.dumps(prompt)[:200])
        self.current += 1
        self.peak = max(self.peak, self.current)
        try:
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
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
    args = parser.parse_args()

    async def serve() -> None:
        server = await asyncio.start_server(StubUpstream(args.token_s).handle, "127.0.0.1", args.port, backlog=4096)
        await server.serve_forever()

    import uvloop

    uvloop.run(serve())


if __name__ == "__main__":
    main()
