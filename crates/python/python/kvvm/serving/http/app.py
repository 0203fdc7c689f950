"""The OpenAI-compatible server over an :class:`~kvvm.serving.engine.Engine`
(:class:`OpenAIServer`): a Starlette application, served by uvicorn (``__main__.py``) or
in-process (:class:`~kvvm.serving.http.run.BackgroundServer`). ``docs/server.md`` is its
reference: routes, parameters, errors, metrics, what differs from OpenAI's API.

The engine steps on its own background loop; a handler submits (never waiting for a step),
then awaits the request's output through the engine's async streams. A client that goes away
has its requests cancelled at once; a full queue is a 429 with ``Retry-After``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ...errors import BackpressureError, InvalidArgumentError
from ..request import Request
from .errors import ApiError, error_response, invalid
from .events import EventStream, merge, until_disconnect
from .metrics import render_metrics
from .protocol import Job, logprobs_chat, logprobs_completion, parse_chat, parse_completion

__all__ = ["OpenAIServer", "ServerConfig"]


@dataclass
class ServerConfig:
    """What the server answers to, besides its engine.

    Attributes:
        model_name: the ``model`` clients name (``/v1/models`` lists it).
        api_keys: tenant keys (``Authorization: Bearer <key>`` on ``/v1/...``), by key, with
            a name each; none: no authentication.
        operator_keys: keys that read ``/metrics`` (and nothing else).
        max_body_bytes: larger request bodies get 413.
    """

    model_name: str
    api_keys: dict[str, str] = field(default_factory=dict)
    operator_keys: dict[str, str] = field(default_factory=dict)
    max_body_bytes: int = 1 << 20


def _finish(r: Request) -> str:
    """OpenAI's finish reason of an engine request (``memory`` after tokens: ``length``)."""
    return "stop" if r.finish_reason == "stop" else "length"


class OpenAIServer:
    """The application (:attr:`app`) and its counters over ``engine``. With
    ``manage_engine`` (the default) the application's lifespan starts the engine's background
    loop and stops it; without, the caller does (several applications over one engine)."""

    def __init__(self, engine: Any, config: ServerConfig, manage_engine: bool = True) -> None:
        self.engine = engine
        self.manage_engine = manage_engine
        self.tokenizer = engine.tokenizer
        self.config = config
        self.created = int(time.time())
        #: HTTP responses by (route, status).
        self.responses: Counter[tuple[str, int]] = Counter()
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
            lifespan=self._lifespan,
        )

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if not self.manage_engine:
            yield
            return
        self.engine.start()
        try:
            yield
        finally:
            self.engine.stop()

    # ---- plumbing ----

    def _count(self, route: str, response: Response) -> Response:
        self.responses[(route, response.status_code)] += 1
        return response

    async def _http_error(self, request: HttpRequest, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        e = ApiError(status, str(getattr(exc, "detail", "")) or "not found", code="not_found" if status == 404 else None)
        return self._count(request.url.path if status != 404 else "unknown", error_response(e))

    async def _internal_error(self, request: HttpRequest, exc: Exception) -> Response:
        e = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return self._count(request.url.path, error_response(e))

    def _auth(self, request: HttpRequest, operator: bool) -> None:
        """Checks ``Authorization: Bearer <key>`` as ``kvvm serve`` does: with keys, a route
        needs one of its kind (401 without a known key, 403 with a key of the other kind)."""
        headers = request.headers.getlist("authorization")
        if len(headers) > 1:
            raise invalid("more than one Authorization header")
        keys = {**self.config.api_keys, **self.config.operator_keys}
        if not keys:
            return
        token = headers[0][7:].strip() if headers and headers[0][:7].lower() == "bearer " else None
        if token is None or token not in keys:
            raise ApiError(401, "a valid API key is needed (Authorization: Bearer <key>)",
                           type="authentication_error", code="invalid_api_key")
        if (token in self.config.operator_keys) != operator:
            raise ApiError(403, "this key may not use this route", type="permission_error", code="forbidden")

    async def _body(self, request: HttpRequest) -> dict[str, Any]:
        """The JSON object of the body (400 when it is not one, 413 past the limit)."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            raise ApiError(413, f"the body is over {self.config.max_body_bytes} bytes", code="body_too_large")
        raw = await request.body()
        if len(raw) > self.config.max_body_bytes:
            raise ApiError(413, f"the body is over {self.config.max_body_bytes} bytes", code="body_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise invalid(f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object")
        model = body.get("model")
        if model != self.config.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")
        return body

    # ---- routes ----

    async def _completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, "/v1/completions", chat=False)

    async def _chat(self, request: HttpRequest) -> Response:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: HttpRequest, route: str, chat: bool) -> Response:
        try:
            self._auth(request, operator=False)
            body = await self._body(request)
            parse = parse_chat if chat else parse_completion
            job = parse(body, self.tokenizer, self.engine.max_len)
            reqs = self._submit(job)
        except ApiError as e:
            return self._count(route, error_response(e))
        if job.stream:
            return self._count(route, EventStream(self._events(job, reqs, chat), lambda: self._cancel(reqs)))
        finished, _ = await until_disconnect(request.receive, self._wait(reqs))
        if not finished:
            await self._cancel(reqs)
            return self._count(route, Response(status_code=499))
        try:
            return self._count(route, JSONResponse(self._response(job, reqs, chat)))
        except ApiError as e:
            return self._count(route, error_response(e))

    def _submit(self, job: Job) -> list[Request]:
        """Queues every sequence of ``job`` (all or none): 400 for what the engine refuses, 429
        with ``Retry-After`` when its queue is full."""
        reqs: list[Request] = []
        try:
            for prompt in job.prompts:
                reqs += self.engine.submit_n(prompt, job.max_tokens, job.n, sampling=job.sampling,
                                             detokenize=self.tokenizer is not None)
        except (InvalidArgumentError, BackpressureError) as e:
            for r in reqs:
                self.engine.cancel(r)
            if isinstance(e, BackpressureError):
                raise ApiError(429, f"the server's queue is full: {e}", type="rate_limit_error",
                               code="queue_full", retry_after=e.retry_after or 1.0) from None
            raise invalid(str(e)) from None
        return reqs

    async def _wait(self, reqs: list[Request]) -> None:
        for r in reqs:
            async for _ in self.engine.astream(r):
                pass

    async def _cancel(self, reqs: list[Request]) -> None:
        """Cancels the requests not finished (off the event loop: a cancel waits for the step
        in flight)."""
        left = [r for r in reqs if not r.done]
        if left:
            await anyio.to_thread.run_sync(lambda: [self.engine.cancel(r) for r in left])

    def _response(self, job: Job, reqs: list[Request], chat: bool) -> dict[str, Any]:
        for r in reqs:
            if r.finish_reason == "error":
                raise ApiError(500, f"the engine failed: {r.error!r}", type="server_error")
            if r.finish_reason == "memory" and not r.tokens:
                raise ApiError(422, "the prompt needs more KV memory than the server's budget can ever hold",
                               param="prompt", code="kv_budget_exceeded")
        choices = []
        for i, r in enumerate(reqs):
            choice: dict[str, Any] = {"index": i, "finish_reason": _finish(r)}
            lps = r.logprobs if job.top_logprobs >= 0 else None
            if chat:
                choice["message"] = {"role": "assistant", "content": r.text}
                choice["logprobs"] = None if lps is None else logprobs_chat(self.tokenizer, lps)
            else:
                choice["text"] = r.text
                choice["logprobs"] = None if lps is None else logprobs_completion(self.tokenizer, lps, 0)
            if job.return_token_ids:
                choice["token_ids"] = list(r.tokens)
            choices.append(choice)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "choices": choices,
            "usage": self._usage(job, reqs),
        }

    def _usage(self, job: Job, reqs: list[Request]) -> dict[str, int]:
        prompt = sum(len(p) for p in job.prompts)
        completion = sum(len(r.tokens) for r in reqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _events(self, job: Job, reqs: list[Request], chat: bool) -> AsyncIterator[str]:
        """The SSE events of a streamed request: OpenAI's chunks, one per delta of a
        sequence, the usage chunk when asked, then ``data: [DONE]``."""
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
        }
        if chat:
            for i in range(len(reqs)):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                yield _event({**head, "choices": [first]})
        offsets = [0] * len(reqs)
        async for i, delta in merge([self.engine.astream(r) for r in reqs]):
            if reqs[i].finish_reason == "error":
                yield _event(ApiError(500, f"the engine failed: {reqs[i].error!r}", type="server_error").body())
                break
            if not delta.tokens and not delta.text and delta.finish_reason is None:
                continue
            finish = None if delta.finish_reason is None else _finish(reqs[i])
            choice: dict[str, Any] = {"index": i, "finish_reason": finish}
            lps = delta.logprobs if job.top_logprobs >= 0 else None
            if chat:
                choice["delta"] = {"content": delta.text} if delta.text or finish is None else {}
                choice["logprobs"] = None if lps is None else logprobs_chat(self.tokenizer, lps)
            else:
                choice["text"] = delta.text
                choice["logprobs"] = None if lps is None else logprobs_completion(self.tokenizer, lps, offsets[i])
            if job.return_token_ids:
                choice["token_ids"] = delta.tokens
            offsets[i] += len(delta.text)
            yield _event({**head, "choices": [choice]})
        if job.include_usage:
            yield _event({**head, "choices": [], "usage": self._usage(job, reqs)})
        yield "data: [DONE]\n\n"

    async def _models(self, request: HttpRequest) -> Response:
        try:
            self._auth(request, operator=False)
        except ApiError as e:
            return self._count("/v1/models", error_response(e))
        model = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "kvvm",
                 "max_model_len": self.engine.max_len}
        return self._count("/v1/models", JSONResponse({"object": "list", "data": [model]}))

    async def _health(self, request: HttpRequest) -> Response:
        ok = self.engine.background
        body = {"status": "ok" if ok else "stopped"}
        return self._count("/health", JSONResponse(body, status_code=200 if ok else 503))

    async def _metrics(self, request: HttpRequest) -> Response:
        try:
            self._auth(request, operator=True)
        except ApiError as e:
            return self._count("/metrics", error_response(e))
        text = render_metrics(self.engine, self.responses)
        return self._count("/metrics", PlainTextResponse(text, media_type="text/plain; version=0.0.4"))


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
