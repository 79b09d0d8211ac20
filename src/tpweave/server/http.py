"""The HTTP front end of `tpweave serve` (aiohttp), on rank 0, in a thread with its own event loop:
/v1/completions, /v1/chat/completions (whole or streamed as server-sent events), /v1/models, /health, /metrics.

A handler parses and checks the request (server/protocol.py: a bad one gets a 400 with an OpenAI-style error body and
never reaches the engine), refuses it with 503 when the server already holds max_pending requests or is shutting
down, then hands each prompt to the engine loop (server/engine_loop.py) and answers from the events the loop sends
back. A client that disconnects cancels its handler (aiohttp's handler cancellation), which aborts its requests: their
KV blocks are freed on every rank at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from typing import Any

from aiohttp import web

from tpweave.server import protocol
from tpweave.server.engine_loop import EngineLoop
from tpweave.server.metrics import ServerMetrics
from tpweave.server.protocol import ParsedRequest, RequestError, ServedModel


class Mailbox:
    """Events from the engine loop's thread to the handlers' event loop, one wake-up per batch: each `post` queues an
    item, and only a post that finds the mailbox empty schedules the flush (call_soon_threadsafe writes to the event
    loop's wake-up pipe and takes its lock; one per request per step would cost the engine's thread that many times
    over at a few hundred streams). The flush hands every queued item to its asyncio.Queue, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """Queue item for `queue` (from any thread)."""
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:  # a flush is already scheduled and has not run
                return
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


def _error(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


class _Choice:
    """One prompt's progress: its tokens, the text already sent (streaming), its end."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text_sent = ""
        self.prefix = 0  # streaming: text is decoded from ids[prefix:], the ids before it already sent as text
        self.read = 0  # ids[prefix:read] decode to the text sent last
        self.reason: str | None = None
        self.error: str | None = None
        self.logprobs: list = []  # a TokenLogprobs per id, where the request asked
        self.offset = 0  # streaming: the text length of the tokens whose logprobs were sent (completions' text_offset)

    @property
    def done(self) -> bool:
        return self.reason is not None or self.error is not None


class OpenAIServer:
    """The aiohttp application over an engine loop (module doc)."""

    def __init__(self, loop: EngineLoop, model: ServedModel, metrics: ServerMetrics, *, api_key: str | None = None,
                 max_pending: int = 1024):  # fmt: skip
        self.engine_loop, self.model, self.metrics = loop, model, metrics
        self.api_key, self.max_pending = api_key, max_pending
        self.accepting = True
        self.pending = 0  # prompts handed to the engine and not ended (this thread's count)
        self._mailbox: Mailbox | None = None  # created on the event loop by the first request
        self.app = web.Application(middlewares=[self._auth])
        self.app.add_routes([
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_page),
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
        ])  # fmt: skip

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key is not None and request.path.startswith("/v1/"):
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode()):
                return _error(RequestError("missing or wrong API key (Authorization: Bearer <key>)", status=401))
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving, 503 once shutting down."""
        return web.json_response({"status": "ok" if self.accepting else "shutting down"},
                                 status=200 if self.accepting else 503)  # fmt: skip

    async def metrics_page(self, request: web.Request) -> web.Response:
        """Prometheus text (server/metrics.py)."""
        return web.Response(body=self.metrics.render(), headers={"Content-Type": ServerMetrics.CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        """The one served model."""
        card = {"id": self.model.name, "object": "model", "created": 0, "owned_by": "tpweave",
                "max_model_len": self.model.max_model_len, "vocab_size": self.model.vocab_size}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrival = time.perf_counter()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(RequestError(f"the request body is not valid JSON: {e}"))
        try:
            req = protocol.parse_request(body, kind, self.model)
        except RequestError as e:
            return _error(e)
        if not self.accepting:
            return _error(RequestError("the server is shutting down", status=503))
        if self.pending + len(req.prompts) > self.max_pending:
            return _error(RequestError(f"the server holds {self.pending} requests (--max-pending {self.max_pending}): "
                                       "try again later", status=503))  # fmt: skip
        events: asyncio.Queue = asyncio.Queue()
        if self._mailbox is None:  # every handler runs on this one event loop
            self._mailbox = Mailbox(asyncio.get_running_loop())
        mailbox = self._mailbox
        keys = [f"{req.request_id}-{i}" for i in range(len(req.prompts))]
        choices = [_Choice() for _ in keys]
        self.pending += len(keys)
        for i, (key, prompt) in enumerate(zip(keys, req.prompts)):

            def sink(event, i=i):
                mailbox.post(events, (i, event))

            self.engine_loop.submit(key, prompt, req.params, sink)
        first_token: float | None = None
        try:
            if req.stream:
                return await self._stream(request, req, events, choices, arrival)
            while not all(c.done for c in choices):
                i, (what, value) = await events.get()
                first_token = first_token or (time.perf_counter() if what == "tokens" else None)
                self._apply(choices[i], what, value)
            self._observe(req, choices, arrival, first_token)
            errors = [c.error for c in choices if c.error]
            if errors:
                return _error(RequestError(errors[0], param="prompt"))
            outputs = [(c.ids, c.reason, c.logprobs) for c in choices]
            return web.json_response(protocol.response(req, self.model, outputs))
        finally:  # a disconnect (CancelledError) or any failure: end what is still running
            for key, c in zip(keys, choices):
                if not c.done:
                    self.engine_loop.abort(key)
            self.pending -= len(keys)

    @staticmethod
    def _apply(choice: _Choice, what: str, value: Any) -> None:
        if what == "tokens":
            choice.ids += value
        elif what == "logprobs":
            choice.logprobs += value
        elif what == "finished":
            choice.reason = value
        else:
            choice.error = value

    def _observe(self, req: ParsedRequest, choices: list[_Choice], arrival: float, first: float | None) -> None:
        now = time.perf_counter()
        generated = sum(len(c.ids) for c in choices)
        if first is not None:
            self.metrics.ttft.observe(first - arrival)
            if generated > 1:
                self.metrics.tpot.observe((now - first) / (generated - 1))
        self.metrics.prompt_tokens.inc(sum(map(len, req.prompts)))
        self.metrics.generation_tokens.inc(generated)
        for c in choices:
            self.metrics.finished(c.reason or "error")

    def _new_text(self, choice: _Choice) -> str:
        """Text of the choice's tokens not sent yet, decoded over a short window (the ids since the last text sent,
        and those before it as context: a tokenizer's spacing depends on the token before), so a long stream does
        not decode its whole output at every step. An incomplete UTF-8 character at the end waits for the next
        token; the last chunk checks the sent text against the whole output's and sends what it lacks."""
        if self.model.tokenizer is None:
            return ""
        if choice.done:
            full = protocol.decode(self.model, choice.ids)
            new = full[len(choice.text_sent) :] if full.startswith(choice.text_sent) else ""
            choice.text_sent = full
            return new
        before = protocol.decode(self.model, choice.ids[choice.prefix : choice.read])
        window = protocol.decode(self.model, choice.ids[choice.prefix :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        new = window[len(before) :]
        choice.prefix, choice.read = choice.read, len(choice.ids)
        choice.text_sent += new
        return new

    async def _stream(self, request: web.Request, req: ParsedRequest, events: asyncio.Queue, choices: list[_Choice],
                      arrival: float) -> web.StreamResponse:  # fmt: skip
        """Server-sent events: a chunk per step with new tokens per choice, the finish reason on each choice's last
        chunk; the usage on the last choice's last chunk, or in a chunk of its own with include_usage."""
        resp: web.StreamResponse | None = None
        first_token, started = None, [False] * len(choices)
        while not all(c.done for c in choices):
            i, (what, value) = await events.get()
            c = choices[i]
            self._apply(c, what, value)
            if what == "logprobs":  # sent with the tokens they belong to, the next event
                continue
            if c.error is not None:
                if resp is None:  # nothing sent yet: an ordinary error response
                    return _error(RequestError(c.error, param="prompt"))
                await self._send(resp, {"error": {"message": c.error, "type": "server_error"}})
                break
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
            if what == "tokens":
                first_token = first_token or time.perf_counter()
            ids = value if what == "tokens" else []
            logprobs = None
            if ids and req.params.logprobs is not None:
                logprobs = protocol.logprobs_body(req, self.model, ids, c.logprobs[len(c.ids) - len(ids) :], c.offset)
                if req.kind == "completion":  # the next chunk's offsets start after these tokens' text
                    c.offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            data = protocol.chunk(req, self.model, i, text=self._new_text(c), token_ids=ids, finish_reason=c.reason,
                                  first=not started[i], logprobs=logprobs)  # fmt: skip
            started[i] = True
            if c.done and all(x.done for x in choices) and not req.include_usage:
                data["usage"] = protocol.usage(sum(map(len, req.prompts)), sum(len(x.ids) for x in choices))
            await self._send(resp, data)
        self._observe(req, choices, arrival, first_token)
        if req.include_usage:
            await self._send(resp, protocol.usage_chunk(req, self.model, sum(len(x.ids) for x in choices)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, data: dict) -> None:
        await resp.write(f"data: {json.dumps(data)}\n\n".encode())


class HttpThread:
    """The aiohttp app served from a thread with its own event loop; start() returns once it listens (or raises
    what kept it from listening, e.g. a port in use)."""

    def __init__(self, app: web.Application, host: str, port: int):
        self.app, self.host, self.port = app, host, port
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._main, name="tpweave-http", daemon=True)

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.TCPSite(self._runner, self.host, self.port).start())
        except BaseException as e:  # noqa: BLE001  (handed to start()'s caller)
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def start(self) -> None:
        """Start serving; returns once listening, or raises OSError naming the address."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise OSError(f"cannot listen on {self.host}:{self.port}: {self._error}") from self._error

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the listener and every connection, then end the thread."""
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)
