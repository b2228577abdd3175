"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of a native or hf backend.

Endpoints: ``POST /v1/chat/completions`` (messages, temperature, top_p, max_tokens / max_completion_tokens,
seed, stop, n=1; no streaming), ``GET /v1/models`` and ``GET /health``. One worker thread owns the model:
requests queue up and the worker takes the oldest one together with up to ``max_batch - 1`` queued
requests that have the same sampling parameters, and generates them as one batch. Greedy requests decode
as they would alone; sampled ones share a batch's random stream, so use ``max_batch=1`` when every
request must be reproducible from its seed alone.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

from eval.backends import Backend, Completion, SamplingParams, make_backend

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
    n: int = 1
    stream: bool = False


class _Job:
    __slots__ = ("messages", "params", "future")

    def __init__(self, messages: list[dict], params: SamplingParams):
        self.messages, self.params, self.future = messages, params, Future()


class Batcher:
    """Owns the backend on one thread; groups queued requests with equal sampling parameters."""

    def __init__(self, backend: Backend, max_batch: int = 8):
        self.backend, self.max_batch = backend, max(1, max_batch)
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="trex-serve-batcher", daemon=True)
        self.thread.start()

    def submit(self, messages: list[dict], params: SamplingParams) -> Future:
        job = _Job(messages, params)
        self.queue.put(job)
        return job.future

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
                j.future.set_exception(e)
            return
        for j, c in zip(batch, outs):
            j.future.set_result(c)


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": None,
                                                               "code": None}})


def create_app(backend: Backend, served_model_name: str, max_batch: int = 8, api_key: str | None = None,
               default_max_tokens: int = 512):
    """A FastAPI app serving ``backend`` as model ``served_model_name``; ``api_key`` requires ``Bearer`` auth."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError

    batcher: Batcher | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal batcher
        batcher = Batcher(backend, max_batch)
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
        if req.n != 1:
            return _error(400, "only n=1 is supported")
        if req.stream:
            return _error(400, "streaming is not supported")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, stop=stop,
                                max_new_tokens=req.max_completion_tokens or req.max_tokens or default_max_tokens,
                                seed=req.seed if req.seed is not None else random.getrandbits(31))
        try:
            comp: Completion = await asyncio.wrap_future(batcher.submit([m.plain() for m in req.messages], params))
        except Exception as e:
            return _error(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
        if comp.finish_reason == "error":
            return _error(400, comp.error or "generation failed")
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": served_model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": comp.text},
                             "finish_reason": comp.finish_reason, "logprobs": None}],
                "usage": {"prompt_tokens": comp.prompt_tokens, "completion_tokens": comp.completion_tokens,
                          "total_tokens": comp.prompt_tokens + comp.completion_tokens}}

    app.state.backend = backend
    return app


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
