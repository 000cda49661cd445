"""The OpenAI-compatible HTTP API on FastAPI, in vLLM's wire format
(``vllm/entrypoints/openai/``; ../shared/SERVING.md "OpenAI-compatible server").

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the target's chat template),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, vLLM's metric names).

- Streaming: ``data: <chunk>\\n\\n`` events then ``data: [DONE]``; the first chat chunk carries
  ``delta: {"role": "assistant", "content": ""}``; ``stream_options.include_usage`` adds a last
  chunk with ``choices: []`` and ``usage``, ``continuous_usage_stats`` puts the running usage on
  every chunk.
- Sampling: ``temperature`` (default 1.0, as OpenAI), ``top_p``, ``top_k`` (vLLM's), ``seed``,
  ``max_tokens`` (chat: also ``max_completion_tokens``), ``stop`` (strings), ``stop_token_ids``,
  ``ignore_eos``; ``n`` must be 1. Fields we do not know are logged and ignored.
- Errors: ``{"error": {"message", "type", "param", "code"}}`` with 400 for a bad request (bad
  JSON, bad values, a prompt the KV cache cannot hold), 404 for an unknown model, 500 for a
  request the engine failed on (the requests batched with it are unaffected: ``runtime/engine.py``,
  failed iterations); once a stream has started an error is sent as a ``data: {"error": ...}``
  event, then ``[DONE]``.
- A client that disconnects aborts its request (its KV blocks are freed) when the engine's next
  iteration begins.
- ``api_key``: every ``/v1`` endpoint needs ``Authorization: Bearer <key>`` (401 otherwise, as
  vLLM's ``--api-key``); ``/health`` and ``/metrics`` stay open.
- Bounds: more than ``ServeConfig.max_waiting_requests`` waiting gives 503 with
  ``Retry-After``; a body over ``max_request_bytes`` gives 413.
- ``logprobs`` / ``top_logprobs``, penalties, ``logit_bias`` and ``best_of`` are refused with 400
  (not computed), never ignored.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import DFlashError
from ..runtime.sampling import SamplingParams
from .service import ENGINE_FAILED, Delta, EngineService, Finished, QueueFull

log = logging.getLogger("dflash_trt.serving")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        kind: str = "BadRequestError",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.kind = message, status, param, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _envelope(rid: str, obj: str, created: int, model: str, choice: dict, usage: dict | None) -> dict:
    """A response object / stream chunk with one choice (and ``usage`` when given)."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        out["usage"] = usage
    return out


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _engine_failed() -> APIError:
    """The 500 of a request the engine failed on (the requests batched with it are unaffected)."""
    return APIError(ENGINE_FAILED, 500, None, "InternalServerError")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _EngineStream(StreamingResponse):
    """A streamed answer whose generator is always closed when the response ends, so that the
    request is aborted in the engine at once when the client goes away. (Starlette cancels
    the response on a disconnect; cancelled while it is sending, it leaves the generator
    suspended at a ``yield`` until garbage collection finalizes it, and the engine runs the
    abandoned request to its last token meanwhile.)"""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


# request fields whose meaning we do not implement: refused when set to anything but their default
UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
}
MAX_REQUEST_BYTES = 8 << 20


def _check_text(value, param: str) -> None:
    """400 for a string (or strings) that cannot be UTF-8 (a lone surrogate from a JSON escape)."""
    for text in [value] if isinstance(value, str) else value or ():
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(f"{param}: not valid Unicode text ({e.reason} at {e.start})", 400, param) from None


class _Bounds:
    """ASGI middleware ahead of the routes: the API key on ``/v1`` paths and the body size limit.
    It answers by itself (401, 413) so a refused request never reaches the route or the engine."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app, self.max_bytes = app, max_request_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    @staticmethod
    async def _refuse(scope, receive, send, err: APIError) -> None:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"].startswith("/v1"):
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = APIError("Unauthorized: a valid API key is required", 401, None, "AuthenticationError")
                return await self._refuse(scope, receive, send, err)
        too_big = APIError(f"the request body is over {self.max_bytes} bytes", 413, None, "RequestTooLargeError")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send, too_big)
        seen, refused = 0, False

        async def counted():  # a chunked body: counted as it arrives
            nonlocal seen, refused
            msg = await receive()
            if msg["type"] == "http.request" and not refused:
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    await self._refuse(scope, receive, send, too_big)
                    return {"type": "http.disconnect"}  # the route stops reading
            return msg

        async def quiet(msg):  # nothing more goes out after the refusal
            if not refused:
                await send(msg)

        await self.app(scope, counted, quiet)


def build_app(
    service: EngineService, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES
) -> FastAPI:
    """The FastAPI application serving ``service``'s model.

    Args:
        api_key: when set, ``/v1`` endpoints need ``Authorization: Bearer <api_key>`` (compared
            in constant time; 401 otherwise).
        max_request_bytes: largest request body (413 beyond it).
    """
    app = FastAPI(title="dflash-trt", version="0.1.0")
    app.add_middleware(_Bounds, api_key=api_key, max_request_bytes=max_request_bytes)
    api = _OpenAI(service)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    return app


async def _api_error(_req, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _validation_error(_req, exc: RequestValidationError):
    """400 in OpenAI's error shape for a body FastAPI could not parse or validate."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return JSONResponse(APIError(f"malformed JSON: {first.get('msg', '')}", 400).body(), status_code=400)
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    msg = first.get("msg", "invalid request")
    return JSONResponse(APIError(f"{where}: {msg}" if where else msg, 400, where).body(), status_code=400)


async def _health():
    return Response(status_code=200)


def _finish_reason(fin: Finished) -> str:
    return "length" if fin.reason == "length" else "stop"


def _completion_prompt(body: CompletionRequest):
    """The one prompt of a completion request: text or token ids.

    Raises:
        APIError: several prompts, an empty one, text that is not valid Unicode.
    """
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise APIError("a list of several prompts is not supported: send one prompt per request", 400, "prompt")
        p = p[0]
    if not p:
        raise APIError("prompt must not be empty", 400, "prompt")
    _check_text(p, "prompt")
    return p


def _chat_messages(body: ChatRequest) -> list[dict]:
    """The conversation as ``{"role", "content"}`` dicts (text parts joined, ``developer`` as
    ``system``).

    Raises:
        APIError: no messages, a part that is not text, text that is not valid Unicode.
    """
    if not body.messages:
        raise APIError("messages must not be empty", 400, "messages")
    messages = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(part.get("type") != "text" for part in content):
                raise APIError("only text content parts are supported", 400, "messages")
            content = "".join(part.get("text", "") for part in content)
        _check_text(content, "messages")
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return messages


def _check_unsupported(body: _Common) -> None:
    """400 for a field set to a value we do not implement; unknown fields are logged."""
    extra = body.model_extra or {}
    for field, defaults in UNSUPPORTED.items():
        if field in extra and not any(extra[field] == d and type(extra[field]) is type(d) for d in defaults):
            raise APIError(f"{field} is not supported by dflash-trt", 400, field)
    unknown = sorted(k for k in extra if k not in UNSUPPORTED)
    if unknown:
        log.info("ignoring unsupported request fields: %s", ", ".join(unknown))


class _OpenAI:
    """The routes of one served model (``service``)."""

    def __init__(self, service: EngineService):
        self.service, self.name = service, service.model_name

    async def models(self):
        s = self.service
        card = {"id": self.name, "object": "model", "created": 0, "owned_by": "dflash-trt"}
        return {"object": "list", "data": [card | {"max_model_len": s.max_model_len}]}

    async def metrics(self):
        return Response(self.service.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def prepare(self, body: _Common, prompt_ids: list[int], max_tokens: int | None):
        """The engine request and stop strings of a checked body.

        Raises:
            APIError: 400 (a bad field), 404 (another model), 503 (the waiting queue is full).
        """
        _check_unsupported(body)
        _check_text(body.stop, "stop")
        if body.model is not None and body.model != self.name:
            raise APIError(f"The model `{body.model}` does not exist.", 404, "model", "NotFoundError")
        if body.n != 1:
            raise APIError(f"n = {body.n} is not supported: dflash-trt returns one choice per request", 400, "n")
        if max_tokens is None:
            max_tokens = self.service.max_model_len - len(prompt_ids)
        try:
            sampling = SamplingParams(body.temperature, body.top_p, body.top_k, body.seed)
            req = self.service.request(prompt_ids, max_tokens, sampling, body.ignore_eos, body.stop_token_ids)
        except QueueFull as e:
            raise APIError(str(e), 503, None, "ServiceUnavailableError", {"Retry-After": "1"}) from None
        except DFlashError as e:
            raise APIError(str(e), 400) from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return req, stop

    async def run(self, http: Request, req, stop):
        """Non-streaming: the whole answer ``(text, Finished)``, or a 499 response when the
        client left (the request is aborted then).

        Raises:
            APIError: 500 when the engine failed on this request.
        """
        text, fin = [], None

        async def collect():
            nonlocal fin
            async for ev in self.service.stream(req, stop):
                if isinstance(ev, Delta):
                    text.append(ev.text)
                else:
                    fin = ev

        task = asyncio.ensure_future(collect())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done and await http.is_disconnected():
                task.cancel()  # leaving the stream aborts the request in the engine
                break
        await asyncio.gather(task, return_exceptions=True)
        if fin is None:
            return Response(status_code=499)
        if fin.reason == "error":
            raise _engine_failed()
        return "".join(text), fin

    async def completions(self, body: CompletionRequest, http: Request):
        p = _completion_prompt(body)
        prompt_ids = self.service.tokenizer.encode(p) if isinstance(p, str) else list(p)
        req, stop = self.prepare(body, prompt_ids, body.max_tokens)
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.name
        head = p if body.echo and isinstance(p, str) else ""

        def chunk(text: str, finish: str | None, usage: dict | None = None) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return _envelope(rid, "text_completion", created, name, choice, usage)

        if body.stream:
            events = _stream(self.service, req, stop, body, chunk, head, len(prompt_ids), None)
            return _EngineStream(events, media_type="text/event-stream")
        got = await self.run(http, req, stop)
        if isinstance(got, Response):
            return got
        text, fin = got
        return chunk(head + text, _finish_reason(fin), _usage(len(prompt_ids), fin.completion_tokens))

    async def chat(self, body: ChatRequest, http: Request):
        from ..prompts import chat_prompt_ids

        messages = _chat_messages(body)
        try:
            prompt_ids = chat_prompt_ids(self.service.tokenizer, messages)
        except DFlashError as e:
            raise APIError(str(e), 400, "messages") from None
        req, stop = self.prepare(body, prompt_ids, body.max_completion_tokens or body.max_tokens)
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.name

        def chunk(text: str, finish: str | None, usage: dict | None = None, first: bool = False) -> dict:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return _envelope(rid, "chat.completion.chunk", created, name, choice, usage)

        if body.stream:
            events = _stream(self.service, req, stop, body, chunk, "", len(prompt_ids), chunk("", None, first=True))
            return _EngineStream(events, media_type="text/event-stream")
        got = await self.run(http, req, stop)
        if isinstance(got, Response):
            return got
        text, fin = got
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(fin)}
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [choice],
            "usage": _usage(len(prompt_ids), fin.completion_tokens),
        }


async def _stream(
    service: EngineService, req, stop, body: _Common, chunk, head: str, prompt_tokens: int, first: dict | None
):
    """The SSE events of one streamed answer (see the module docstring)."""
    opts = body.stream_options or StreamOptions()
    cont = opts.continuous_usage_stats
    done, failed = 0, False
    try:
        if first is not None:
            if cont:
                first["usage"] = _usage(prompt_tokens, 0)
            yield _sse(first)
        if head:
            yield _sse(chunk(head, None, _usage(prompt_tokens, 0) if cont else None))
        async for ev in service.stream(req, stop):
            if isinstance(ev, Delta):
                done += ev.tokens
                yield _sse(chunk(ev.text, None, _usage(prompt_tokens, done) if cont else None))
            elif ev.reason == "error":  # (the engine has logged why)
                failed = True
                yield _sse(_engine_failed().body())
            else:
                done = ev.completion_tokens
                finish = "length" if ev.reason == "length" else "stop"
                yield _sse(chunk("", finish, _usage(prompt_tokens, done) if cont else None))
        if opts.include_usage and not failed:
            obj = chunk("", None)
            obj["choices"] = []
            obj["usage"] = _usage(prompt_tokens, done)
            yield _sse(obj)
    except Exception as e:  # an error after the stream started: tell the client inside the stream
        log.exception("stream failed")
        yield _sse(APIError(f"{type(e).__name__}: {e}", 500, None, "InternalServerError").body())
    yield "data: [DONE]\n\n"
