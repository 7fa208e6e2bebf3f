"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models; /health, /metrics
(Prometheus), and vLLM's /tokenize and /detokenize.

    app = create_app(llm, "my-model", api_key=None)   # served by uvicorn (tileinfer serve)

Handlers run on the asyncio loop and never call the engine: they hand each request to the EngineThread
and await its events (engine_thread.py). A request is refused with OpenAI's error shape and status 400
before anything streams, so a streaming client sees a bad request as an HTTP error too. A streaming
client that goes away aborts its request, and the engine frees its pages.

Stopping (lifecycle.py; graceful.py turns SIGTERM and Ctrl-C into it): /health answers 503 "stopping" and
new requests 503 at once, requests in flight run on for a grace period, what is left is aborted.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..chat import render_chat
from ..model.tokenizer import CHAT_TEMPLATE
from .engine_thread import Added, Busy, Delta, EngineThread, Failed, Finished, Rejected, Submission
from .lifecycle import Lifecycle
from .metrics import ServerMetrics
from .reasoning import ReasoningStream, split
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       validation_message)

log = logging.getLogger("tileinfer.server")


def create_app(llm, served_model_name: str, api_key: str | None = None, max_waiting: int | None = None) -> FastAPI:
    """The app over a loaded LLM; max_waiting: requests waiting for admission at most (more are answered 503)."""
    metrics = ServerMetrics()
    engine = EngineThread(llm.engine, metrics, max_waiting=max_waiting)
    lifecycle = Lifecycle(engine)  # loading -> serving -> stopping: what /health says

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        lifecycle.serving()
        yield
        lifecycle.stop_accepting()
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="TileInfer", lifespan=lifespan)
    app.state.engine_thread = engine
    app.state.lifecycle = lifecycle
    _add_error_handlers(app)
    template = llm.runner.checkpoint.chat_template or CHAT_TEMPLATE
    tokenizer = llm.tokenizer
    max_context = llm.config.max_context

    @app.get("/health")
    async def health():
        status = lifecycle.phase if engine.error is None else f"failed: {engine.error}"
        code = 200 if status == "serving" and engine.serving else 503
        return JSONResponse({"status": status, "requests": engine.num_requests}, status_code=code)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    auth = [Depends(_api_key_check(api_key))]

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest):
        _check_model(body.model, served_model_name)
        if body.messages is not None:
            try:
                text = render_chat(template, [m.as_template_dict() for m in body.messages],
                                   add_generation_prompt=body.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        else:
            text = body.prompt
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        return {"count": len(ids), "max_model_len": max_context, "tokens": ids}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest):
        _check_model(body.model, served_model_name)
        vocab = llm.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    v1 = APIRouter(prefix="/v1", dependencies=auth)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tileinfer", "max_model_len": max_context}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest):
        _check_model(body.model, served_model_name)
        _note_ignored(body, "/v1/completions")
        sampling = body.sampling(body.max_tokens, body.logprobs)
        sub = await _start(engine, body.one_prompt(), sampling, body.stream)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served_model_name}
        if body.stream:
            return _sse(_stream_completion(engine, sub, head, body.include_usage))
        out = await _result(engine, sub)
        logprobs = _completion_logprobs(out, tokenizer, body.logprobs) if body.logprobs is not None else None
        return {**head, "choices": [{"index": 0, "text": out.text, "logprobs": logprobs,
                                     "finish_reason": out.finish_reason}], "usage": _usage(out)}

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        _check_model(body.model, served_model_name)
        _note_ignored(body, "/v1/chat/completions")
        try:
            prompt = render_chat(template, [m.as_template_dict() for m in body.messages],
                                 **(body.chat_template_kwargs or {}))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        top_n = body.top_n()
        sampling = body.sampling(body.reply_budget(), top_n)
        sub = await _start(engine, prompt, sampling, body.stream, renames={"logprobs": "top_logprobs",
                                                                           "prompt": "messages"})
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": served_model_name}
        if body.stream:
            return _sse(_stream_chat(engine, sub, {**head, "object": "chat.completion.chunk"}, body.include_usage))
        out = await _result(engine, sub)
        logprobs = _chat_logprobs(out, tokenizer, top_n) if top_n is not None else None
        return {**head, "choices": [{"index": 0, "message": chat_message(out.text), "logprobs": logprobs,
                                     "finish_reason": out.finish_reason}], "usage": _usage(out)}

    app.include_router(v1)
    return app


# ---------------------------------------------------------------------------- errors, auth
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError):
        message, param = validation_message(e.errors())
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)  # the traceback stays in the log
        return JSONResponse(APIError(500, f"internal server error ({type(e).__name__}); the server log has the "
                                          f"details", type="server_error").body(), status_code=500)


def _note_ignored(body, route: str) -> None:
    if body.ignored:
        log.warning("%s: ignoring fields this server does not use: %s", route, ", ".join(body.ignored))


def _api_key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                "key the server was started with (--api-key)", code="invalid_api_key")
    return check


def _check_model(model: str | None, served: str) -> None:
    """None (allowed where the body may omit the model) means the served one."""
    if model is not None and model != served:
        raise APIError(404, f"the model '{model}' does not exist: this server serves '{served}' (GET /v1/models)",
                       param="model", code="model_not_found")


# ---------------------------------------------------------------------------- one request's events
async def _start(engine: EngineThread, prompt, sampling: dict, stream: bool, renames: dict | None = None
                 ) -> Submission:
    """Hand the request to the engine thread and wait until it was taken; APIError if it was refused."""
    sub = Submission(prompt, sampling, stream, asyncio.get_running_loop())
    engine.submit(sub)
    event = await _next(engine, sub)
    if isinstance(event, Rejected):
        param = (renames or {}).get(event.param, event.param)
        raise APIError(400, event.message, param=param)
    if isinstance(event, Busy):
        raise APIError(503, event.message, type="server_error", code="server_busy")
    if isinstance(event, Failed):
        raise APIError(503, event.message, type="server_error")
    assert isinstance(event, Added), event
    return sub


async def _next(engine: EngineThread, sub: Submission):
    """The request's next event; a handler cancelled while waiting (client gone, shutdown) aborts it."""
    try:
        return await sub.events.get()
    except asyncio.CancelledError:
        engine.abort(sub)
        raise


async def _result(engine: EngineThread, sub: Submission):
    while True:
        event = await _next(engine, sub)
        if isinstance(event, Finished):
            return event.output
        if isinstance(event, Failed):
            raise APIError(503, event.message, type="server_error")


def chat_message(text: str) -> dict:
    """The assistant's message: Qwen3's reasoning (a reply opening with <think>) as reasoning_content."""
    reasoning, content = split(text)
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


def _usage(out) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------- streaming
def _sse(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(engine: EngineThread, sub: Submission):
    """The request's events until the last; if the stream stops early (the client went away), abort it."""
    done = False
    try:
        while not done:
            event = await _next(engine, sub)
            done = isinstance(event, (Finished, Failed))
            yield event
    finally:
        if not done:
            engine.abort(sub)


async def _stream_completion(engine: EngineThread, sub: Submission, head: dict, include_usage: bool):
    def choice(text: str, finish_reason=None) -> dict:
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    async for event in _events(engine, sub):
        if isinstance(event, Delta) and event.text:
            yield _data(choice(event.text))
        elif isinstance(event, Finished):
            yield _data(choice("", event.output.finish_reason))
            if include_usage:
                yield _data({**head, "choices": [], "usage": _usage(event.output)})
        elif isinstance(event, Failed):
            yield _data(APIError(503, event.message, type="server_error").body())
    yield "data: [DONE]\n\n"


async def _stream_chat(engine: EngineThread, sub: Submission, head: dict, include_usage: bool):
    def choice(delta: dict, finish_reason=None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def parts(reasoning: str, content: str):
        if reasoning:
            yield _data(choice({"reasoning_content": reasoning}))
        if content:
            yield _data(choice({"content": content}))

    yield _data(choice({"role": "assistant", "content": ""}))
    split_stream = ReasoningStream()
    async for event in _events(engine, sub):
        if isinstance(event, Delta) and event.text:
            for chunk in parts(*split_stream.feed(event.text)):
                yield chunk
        elif isinstance(event, Finished):
            for chunk in parts(*split_stream.finish()):
                yield chunk
            yield _data(choice({}, event.output.finish_reason))
            if include_usage:
                yield _data({**head, "choices": [], "usage": _usage(event.output)})
        elif isinstance(event, Failed):
            yield _data(APIError(503, event.message, type="server_error").body())
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- logprobs
def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely tokens (the engine's entry lists them first, then the sampled one if it is not among them)."""
    return list(entry.items())[:n]


def _completion_logprobs(out, tokenizer, n: int) -> dict:
    tokens, token_logprobs, top_logprobs, offsets, at = [], [], [], [], 0
    for token, entry in zip(out.token_ids, out.logprobs or []):
        text = tokenizer.decode([token], skip_special_tokens=False)
        tokens.append(text)
        token_logprobs.append(entry[token])
        top_logprobs.append({tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in _top(entry, n)})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _chat_logprobs(out, tokenizer, n: int) -> dict:
    def item(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [{**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, n)]}
               for token, entry in zip(out.token_ids, out.logprobs or [])]
    return {"content": content}
