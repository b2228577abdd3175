"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of a native or hf backend.

Endpoints: ``POST /v1/chat/completions`` (messages, temperature, top_p, max_tokens / max_completion_tokens,
seed, stop, ``n`` choices, ``stream`` with ``stream_options.include_usage``), ``GET /v1/models`` and
``GET /health``.

The native backend is served with continuous batching (:class:`EngineBatcher`): one thread owns a
:class:`trainer.generate.DecodeBatch`; between two decode steps it prefills the requests that arrived (up to
``max_batch`` rows in all) and adds them to the batch, and finished rows leave. Every row keeps its own
sampling parameters, stop strings, token budget and random generator (seeded with the request's ``seed``,
a random one when the request gives none), so an answer is the one the request gets alone, whatever else is
being decoded. Choice ``i`` of a request with ``n > 1`` samples with seed ``seed + i`` (so choice ``i`` of
``n`` equals the answer of a single request with that seed); a greedy request (temperature 0) decodes one row
and answers its ``n`` equal choices from it.

Other backends (hf) are served by :class:`Batcher`: the worker takes the oldest queued request with up to
``max_batch - 1`` queued requests of equal sampling parameters (the seed included) and generates them with
one ``backend.generate`` call; a streamed answer arrives as one content delta.

Streaming (``stream=True``) sends server-sent events in OpenAI's ``chat.completion.chunk`` format: a role
delta per choice, content deltas (text is held back while it may be the start of a stop string or ends in
an incomplete character, so the deltas join to exactly the unstreamed answer), a final chunk per choice with
its ``finish_reason``, a usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``. A
client that disconnects cancels its rows at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import queue
import random
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

from eval.backends import Backend, Completion, SamplingParams, make_backend, truncate_at_stop

SERVE_KINDS = ("native", "hf")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    def plain(self) -> dict:
        """``{"role", "content"}`` with text parts joined and ``developer`` read as ``system``."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat-completion request that is honoured; other fields are ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None


class BadRequest(ValueError):
    """A request the backend cannot serve (bad messages, a prompt too long for the model)."""


class _Request:
    """Where one HTTP request's ``n`` choices report, from the batcher's thread: an asyncio queue of
    ``(index, kind, payload)`` items, ``kind`` one of ``delta`` (text), ``done`` (a Completion) or ``error``."""

    def __init__(self, n: int, stream: bool, loop: asyncio.AbstractEventLoop):
        self.n, self.stream, self.loop = n, stream, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rows: list = []  # decode rows to cancel when the client goes away

    def push(self, index: int, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, kind, payload))
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        for row in self.rows:
            row.cancelled = True

    async def results(self) -> list[Completion]:
        """The ``n`` completions, once all are done (an ``error`` item is raised)."""
        out: list[Completion | None] = [None] * self.n
        left = self.n
        while left:
            i, kind, payload = await self.queue.get()
            if kind == "error":
                raise payload
            if kind == "done":
                out[i], left = payload, left - 1
        return out


def _sendable(text: str, stops: list[str]) -> int:
    """How much of a growing ``text`` can be streamed: not an incomplete trailing character (decoded as
    U+FFFD) nor a trailing piece that may be the start of a stop string."""
    end = len(text.rstrip("\ufffd"))
    hold = max((k for s in stops for k in range(1, len(s) + 1) if k <= end and text.endswith(s[:k], 0, end)),
               default=0)
    return end - hold


class _Choice:
    """One decode row of a request and the choice indices it answers (a greedy row answers all ``n``)."""

    def __init__(self, request: _Request, row, indices: list[int], stop: list[str]):
        self.request, self.row, self.indices, self.stop = request, row, indices, stop
        self.seen = self.sent = 0  # tokens looked at, characters streamed

    def publish(self, backend) -> None:
        """Push what is new: a text delta (streamed requests) and, once the row has finished, its completion."""
        row, done = self.row, self.row.finish_reason is not None
        if done and row.finish_reason == "cancelled":
            return
        if self.request.stream and (done or len(row.tokens) > self.seen):
            text = truncate_at_stop(backend.tok.decode(row.tokens), self.stop)[0]
            end = len(text) if done else _sendable(text, self.stop)
            if end > self.sent:
                for i in self.indices:
                    self.request.push(i, "delta", text[self.sent:end])
                self.sent = end
        self.seen = len(row.tokens)
        if done:
            comp = backend.completion(row, self.stop)
            for i in self.indices:
                self.request.push(i, "done", comp)


class EngineBatcher:
    """Continuous batching on the native backend's model (see the module docstring). ``forward_passes``
    counts model forwards; :meth:`hold` / :meth:`release` and :meth:`wait_queued` let a test or a benchmark
    queue requests before they are admitted together."""

    def __init__(self, backend, max_batch: int = 8):
        from trainer.generate import DecodeBatch

        self.backend, self.max_batch = backend, max(1, max_batch)
        self.batch = DecodeBatch(backend.net, backend.end_ids, backend.tok.pad_id)
        self.cond = threading.Condition()
        self.waiting: deque[_Choice] = deque()
        self.running: list[_Choice] = []
        self.held = self.closing = False
        self.thread = threading.Thread(target=self._loop, name="trex-serve-engine", daemon=True)
        self.thread.start()

    @property
    def forward_passes(self) -> int:
        return self.batch.forward_passes

    def submit(self, messages: list[dict], params: SamplingParams, request: _Request) -> None:
        ids, err = self.backend.prompt(messages)
        if err is not None:
            raise BadRequest(err.error)
        if params.temperature > 0:
            groups = [[i] for i in range(request.n)]
        else:
            groups = [list(range(request.n))]
        choices = [_Choice(request, self.backend.row(ids, params, params.seed + g[0]), g, params.stop)
                   for g in groups]
        request.rows = [c.row for c in choices]
        with self.cond:
            self.waiting.extend(choices)
            self.cond.notify_all()

    def hold(self) -> None:
        """Admit no new rows until :meth:`release` (running rows go on)."""
        with self.cond:
            self.held = True

    def release(self) -> None:
        with self.cond:
            self.held = False
            self.cond.notify_all()

    def wait_queued(self, rows: int, timeout: float) -> bool:
        """Block until at least ``rows`` rows wait to be admitted (False after ``timeout`` seconds)."""
        with self.cond:
            return self.cond.wait_for(lambda: len(self.waiting) >= rows, timeout)

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closing or self.running or (self.waiting and not self.held))
                if self.closing:
                    break
                room = 0 if self.held else self.max_batch - len(self.running)
                joining = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            try:
                if joining:
                    self.batch.add([c.row for c in joining])
                    self.running += joining
                    self._publish(joining)
                if self.running:
                    self.batch.step()
                    self._publish(self.running)
            except Exception as e:  # the model failed: every request in the batch learns why
                self._fail(self.running + [c for c in joining if c not in self.running], e)
        with self.cond:
            self._fail(self.running + list(self.waiting), RuntimeError("the server is shutting down"))

    def _publish(self, choices: list[_Choice]) -> None:
        for c in choices:
            c.publish(self.backend)
        self.running = [c for c in self.running if c.row.finish_reason is None]

    def _fail(self, choices: list[_Choice], e: Exception) -> None:
        from trainer.generate import DecodeBatch

        for c in choices:
            for i in c.indices:
                c.request.push(i, "error", e)
        passes = self.batch.forward_passes
        self.batch = DecodeBatch(self.backend.net, self.backend.end_ids, self.backend.tok.pad_id)
        self.batch.forward_passes = passes
        self.running = []


class _Job:
    __slots__ = ("messages", "params", "request", "indices")

    def __init__(self, messages: list[dict], params: SamplingParams, request: _Request, indices: list[int]):
        self.messages, self.params, self.request, self.indices = messages, params, request, indices

    def finish(self, comp: Completion) -> None:
        for i in self.indices:
            if self.request.stream and comp.text and comp.finish_reason != "error":
                self.request.push(i, "delta", comp.text)
            self.request.push(i, "done", comp)


class Batcher:
    """Owns any backend on one thread; groups queued requests with equal sampling parameters."""

    def __init__(self, backend: Backend, max_batch: int = 8):
        self.backend, self.max_batch = backend, max(1, max_batch)
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="trex-serve-batcher", daemon=True)
        self.thread.start()

    def submit(self, messages: list[dict], params: SamplingParams, request: _Request) -> None:
        if params.temperature > 0:  # choice i samples with seed + i; greedy choices are all the same
            for i in range(request.n):
                self.queue.put(_Job(messages, params.model_copy(update={"seed": params.seed + i}), request, [i]))
        else:
            self.queue.put(_Job(messages, params, request, list(range(request.n))))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        pending: deque[_Job] = deque()
        closing = False
        while pending or not closing:
            if not pending:
                job = self.queue.get()
                if job is None:
                    break
                pending.append(job)
            while True:  # everything that arrived meanwhile
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                else:
                    pending.append(job)
            first = pending.popleft()
            batch = [first]
            for job in list(pending):
                if len(batch) >= self.max_batch:
                    break
                if job.params == first.params:
                    batch.append(job)
                    pending.remove(job)
            self._run(batch)

    def _run(self, batch: list[_Job]) -> None:
        try:
            outs = self.backend.generate([j.messages for j in batch], batch[0].params)
        except Exception as e:  # the model failed as a whole: every request of the batch learns why
            for j in batch:
                for i in j.indices:
                    j.request.push(i, "error", e)
            return
        for j, c in zip(batch, outs):
            j.finish(c)


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": None,
                                                               "code": None}})


def _usage(comps: list[Completion]) -> dict:
    prompt, completion = comps[0].prompt_tokens, sum(c.completion_tokens for c in comps)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(backend: Backend, served_model_name: str, max_batch: int = 8, api_key: str | None = None,
               default_max_tokens: int = 512):
    """A FastAPI app serving ``backend`` as model ``served_model_name``; ``api_key`` requires ``Bearer`` auth.
    The batcher (:class:`EngineBatcher` for the native backend, else :class:`Batcher`) runs while the app
    does, as ``app.state.batcher``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse

    batcher: EngineBatcher | Batcher | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal batcher
        batcher = EngineBatcher(backend, max_batch) if backend.kind == "native" else Batcher(backend, max_batch)
        app.state.batcher = batcher
        yield
        batcher.close()

    app = FastAPI(title="T-Rex OpenAI-compatible server", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _error(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served_model_name, "backend": backend.kind}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "trex", "root": backend.model}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if req.model not in (None, served_model_name):
            return _error(404, f"model {req.model!r} is not served here (serving {served_model_name!r})",
                          "not_found_error")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, stop=[s for s in stop if s],
                                max_new_tokens=req.max_completion_tokens or req.max_tokens or default_max_tokens,
                                seed=req.seed if req.seed is not None else random.getrandbits(31))
        request = _Request(req.n, req.stream, asyncio.get_running_loop())
        try:
            batcher.submit([m.plain() for m in req.messages], params, request)
        except BadRequest as e:
            return _error(400, str(e))
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_events(request, cid, served_model_name, usage), media_type="text/event-stream")
        try:
            comps = await request.results()
        except Exception as e:
            return _error(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
        failed = next((c for c in comps if c.finish_reason == "error"), None)
        if failed is not None:
            return _error(400, failed.error or "generation failed")
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": served_model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason, "logprobs": None} for i, c in enumerate(comps)],
                "usage": _usage(comps)}

    app.state.backend = backend
    return app


async def _events(request: _Request, cid: str, model: str, include_usage: bool):
    """The server-sent events of a streamed request (see the module docstring)."""
    created = int(time.time())

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def choice(i: int, delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    try:
        yield chunk([choice(i, {"role": "assistant", "content": ""}) for i in range(request.n)])
        comps: list[Completion | None] = [None] * request.n
        left = request.n
        while left:
            i, kind, payload = await request.queue.get()
            if kind == "delta":
                yield chunk([choice(i, {"content": payload})])
                continue
            if kind == "error" or payload.finish_reason == "error":
                message = payload.error if kind == "done" else f"generation failed: {type(payload).__name__}: {payload}"
                yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
                return
            comps[i], left = payload, left - 1
            yield chunk([choice(i, {}, payload.finish_reason)])
        if include_usage:
            yield chunk([], _usage(comps))
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away: its rows leave the batch
        request.cancel()


def default_model_name(model: str | Path) -> str:
    """The directory's name (its parent's, for a stage output's ``export/``)."""
    p = Path(model).resolve()
    return p.parent.name if p.name == "export" else p.name


def serve(model: str | Path, backend: str = "native", host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | None = None, max_batch: int = 8, api_key: str | None = None,
          default_max_tokens: int = 512, log_level: str = "info", **backend_opts: Any) -> None:
    """Load ``model`` with the ``native`` or ``hf`` backend and serve it until interrupted."""
    import uvicorn

    if backend not in SERVE_KINDS:
        raise ValueError(f"cannot serve backend {backend!r}; valid: {', '.join(SERVE_KINDS)}")
    b = make_backend(backend, str(model), **backend_opts)
    app = create_app(b, served_model_name or default_model_name(model), max_batch, api_key, default_max_tokens)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


@contextmanager
def background_server(app, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``app`` with uvicorn on a thread (port 0: a free one); yields the base URL, e.g.
    ``http://127.0.0.1:54321``, once it accepts connections, and stops it afterwards."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="trex-serve-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
