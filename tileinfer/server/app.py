"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models; /health, /metrics
(Prometheus), and vLLM's /tokenize and /detokenize.

    engine = EngineClient(model_dir, llm_options); engine.start()
    app = create_app(engine, "my-model", api_key=None)   # served by uvicorn (tileinfer serve)

With allowed_origins (--allowed-origins), browser pages from those origins may call it: CORS preflights are
answered and responses carry Access-Control-Allow-Origin; without it no CORS header is sent, so a page from
another origin cannot read a response.

Handlers run on the asyncio loop and never call the engine, which runs in a process of its own: they hand
each request to the EngineClient and await its events (engine_client.py, events.py). A request is refused
with OpenAI's error shape and status 400 before anything streams, so a streaming client sees a bad request
as an HTTP error too. A streaming client that goes away aborts its request, and the engine frees its pages.

A streamed request's first token is timed from the request's arrival at the app (the ASGI call, before its
body is parsed) to its first chunk with text handed to the connection: the histogram
tileinfer_http_time_to_first_token_seconds of /metrics, beside the engine's own time to first token.

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
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from ..model.chat_template import render_chat
from ..model.tokenizer import encode_text
from .engine_client import EngineClient, Submission
from .events import Added, Busy, Failed, Finished, Rejected, is_delta
from .lifecycle import Lifecycle
from . import tools
from .reasoning import ReasoningStream, split
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       validation_message)

log = logging.getLogger("tileinfer.server")


def create_app(engine: EngineClient, served_model_name: str, api_key: str | None = None,
               allowed_origins: list[str] | None = None) -> FastAPI:
    """The app over a started EngineClient; the app's shutdown stops the engine. allowed_origins: origins
    (scheme://host[:port], or "*") whose browser pages may call it."""
    lifecycle = Lifecycle(engine)  # loading -> serving -> stopping: what /health says

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        lifecycle.serving()
        yield
        lifecycle.stop_accepting()
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="TileInfer", lifespan=lifespan)
    app.state.engine = engine
    app.state.lifecycle = lifecycle
    _add_error_handlers(app)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    template, tokenizer = engine.chat_template, engine.tokenizer
    max_context, metrics = engine.max_context, engine.metrics

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
            field = "messages"
            try:
                text = render_chat(template, [m.as_template_dict() for m in body.messages],
                                   add_generation_prompt=body.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, str(e), param=field) from None
        else:
            field, text = "prompt", body.prompt
        try:
            ids = encode_text(tokenizer, text, field)
        except ValueError as e:
            raise APIError(400, str(e), param=field) from None
        return {"count": len(ids), "max_model_len": max_context, "tokens": ids}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest):
        _check_model(body.model, served_model_name)
        vocab = engine.vocab_size
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
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, served_model_name)
        body.refuse_unsupported()
        _note_ignored(body, "/v1/completions")
        prompts = body.prompts()
        sampling = body.sampling(body.max_tokens, body.logprobs)
        sub = await _start(engine, prompts, sampling, body.stream, body.n, request.scope[ARRIVAL],
                           renames={"structured_outputs": body.structured_param})
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served_model_name}
        echoes = [_prompt_text(p, tokenizer) if body.echo else "" for p in prompts for _ in range(body.n)]
        if body.stream:
            return EventStream(_stream_completion(engine, sub, head, body.include_usage, echoes, body.logprobs,
                                                  tokenizer))
        outs = await _results(engine, sub, request)
        choices = [{"index": i, "text": echoes[i] + out.text, "finish_reason": out.finish_reason,
                    "logprobs": _completion_logprobs(_pairs(out), tokenizer, body.logprobs)[0]
                    if body.logprobs is not None else None} for i, out in enumerate(outs)]
        return {**head, "choices": choices, "usage": _usage(sub, outs)}

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, served_model_name)
        body.refuse_unhonoured()
        _note_ignored(body, "/v1/chat/completions")
        try:
            prompt = render_chat(template, [m.as_template_dict() for m in body.messages], **body.template_variables())
        except ValueError as e:
            raise APIError(400, str(e), param=body.template_param) from None
        top_n = body.top_n()
        sampling = body.sampling(body.reply_budget(), top_n)
        sub = await _start(engine, [prompt], sampling, body.stream, body.n, request.scope[ARRIVAL],
                           renames={"logprobs": "top_logprobs", "prompt": "messages",
                                    "structured_outputs": body.structured_param,
                                    "max_tokens": body.reply_budget_param})
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": served_model_name}
        if body.stream:
            return EventStream(_stream_chat(engine, sub, {**head, "object": "chat.completion.chunk"},
                                            body.include_usage, top_n, tokenizer, body.uses_tools))
        outs = await _results(engine, sub, request)
        choices = []
        for i, out in enumerate(outs):
            message = chat_message(out.text, body.uses_tools)
            choices.append({"index": i, "message": message, "logprobs": _chat_logprobs(_pairs(out), tokenizer, top_n)
                            if top_n is not None else None,
                            "finish_reason": "tool_calls" if message.get("tool_calls") else out.finish_reason})
        return {**head, "choices": choices, "usage": _usage(sub, outs)}

    app.include_router(v1)
    app.add_middleware(_Arrival)
    return app


ARRIVAL = "tileinfer.arrival"  # the scope key of a request's arrival (time.perf_counter())


class _Arrival:
    """Stamps each HTTP request's scope with its arrival, before the app parses anything of it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[ARRIVAL] = time.perf_counter()
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------- errors, auth
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError):
        message, param = validation_message(e.errors())
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody is there to read it

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
async def _start(engine: EngineClient, prompts: list, sampling: dict, stream: bool, n: int, arrival: float,
                 renames: dict | None = None) -> Submission:
    """Hand the request to the engine and wait until it was taken; APIError if it was refused. arrival: when the
    request reached the app (time.perf_counter())."""
    sub = Submission(prompts, sampling, stream, asyncio.get_running_loop(), arrival, n=n)
    engine.submit(sub)
    event = await _next(engine, sub)
    if isinstance(event, Rejected):
        param = (renames or {}).get(event.param, event.param)
        raise APIError(400, event.message, param=param)
    if isinstance(event, Busy):
        raise APIError(503, event.message, type="server_error", code="server_busy")
    if isinstance(event, Failed):
        raise APIError(event.status, event.message, type="server_error")
    assert isinstance(event, Added), event
    sub.prompt_tokens = event.prompt_tokens
    return sub


async def _next(engine: EngineClient, sub: Submission):
    """The request's next event."""
    if not sub.backlog:
        await _receive(engine, sub)
    return sub.backlog.popleft()


async def _batch(engine: EngineClient, sub: Submission) -> list:
    """Every event of the request queued now, in order (waits for the first): a handler that fell behind
    the engine takes several steps' tokens at once, and answers them in one write."""
    if not sub.backlog:
        await _receive(engine, sub)
    events = list(sub.backlog)
    sub.backlog.clear()
    return events


async def _receive(engine: EngineClient, sub: Submission) -> None:
    """Move what the engine queued into sub.backlog, waiting for it if nothing is; a handler cancelled
    while waiting (client gone, shutdown) aborts the request."""
    try:
        sub.backlog.extend(await sub.events.get())
    except asyncio.CancelledError:
        engine.abort(sub)
        raise
    while not sub.events.empty():
        sub.backlog.extend(sub.events.get_nowait())


async def _results(engine: EngineClient, sub: Submission, request: Request) -> list:
    """Every choice's RequestOutput, in choice order. If the client goes away first, the request is
    aborted (its pages go back) and nothing is answered."""
    async def collect() -> list:
        outs = [None] * sub.num_choices
        for _ in range(sub.num_choices):
            event = await _next(engine, sub)
            while is_delta(event):
                event = await _next(engine, sub)
            if isinstance(event, Failed):
                raise APIError(503, event.message, type="server_error")
            outs[event.index] = event.output
        return outs

    result, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request.receive))
    await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
    if not result.done():
        result.cancel()  # _next aborts the request
        log.info("%s: the client went away; its request was aborted", request.url.path)
        raise ClientGone()
    gone.cancel()
    return result.result()


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer (nobody reads the reply)."""


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected (or, for uvicorn, once the response is complete). The body
    was read already, so the next ASGI message is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


def chat_message(text: str, uses_tools: bool = False) -> dict:
    """The assistant's message: Qwen3's reasoning (a reply opening with <think>) as reasoning_content; with
    tools, the calls in the reply as tool_calls (content None if nothing else is left)."""
    reasoning, content = split(text)
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if uses_tools:
        content, calls = tools.parse(content)
        if calls:
            message.update(content=content or None, tool_calls=[c.as_dict() for c in calls])
    return message


def _usage(sub: Submission, outs) -> dict:
    """Each prompt counted once however many choices it has; every choice's tokens."""
    prompt, completion = sum(sub.prompt_tokens), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prompt_text(prompt, tokenizer) -> str:
    """A prompt as text (echo): as given, or its token ids decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)


# ---------------------------------------------------------------------------- streaming
class EventStream(Response):
    """A text/event-stream response: one ASGI body message per str that `chunks` (a stream's generator, _stream)
    yields. What Starlette's StreamingResponse does, in plain asyncio and for less a chunk (no anyio task group).
    uvicorn's send does not tell a writer that its client is gone (it drops the message), so a disconnect is
    seen by receive() alone: one task writes the chunks, one awaits the disconnect, for the whole stream. A
    client that goes away cancels the writer, which closes `chunks`: the stream's request is aborted at once,
    not at its next event."""
    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[str, None]):
        self.chunks = chunks
        self.status_code = 200
        self.background = None  # FastAPI reads it (it puts an endpoint's BackgroundTasks here; ours have none)
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((writer, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also if this task is cancelled (uvicorn's forced shutdown): no task outlives the response
            gone.cancel()
            writer.cancel()  # nothing if the stream ended; else its client is gone and the request is aborted
            await asyncio.wait((writer, gone))
        if not writer.cancelled():
            writer.result()  # an error the stream raised goes to the app's error handling, as any handler's

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        finally:
            await self.chunks.aclose()  # cancelled in send: the generator's finally (the abort) runs now
        await send({"type": "http.response.body", "body": b"", "more_body": False})


_encode = json.JSONEncoder(ensure_ascii=False).encode  # one for all: json.dumps(ensure_ascii=False) makes one a call


def _json(value) -> str:
    """value in JSON, as json.dumps(value, ensure_ascii=False) writes it; None without the encoder (a chunk's
    usual logprobs and finish_reason), a str by the encoder's C escaper alone."""
    return "null" if value is None else _encode(value)


def _data(obj) -> str:
    return f"data: {_json(obj)}\n\n"


def _chunk_prefix(head: dict) -> str:
    """A stream's Server-Sent Event up to its one choice: the fields every chunk repeats, encoded once."""
    return f"data: {_json(head)[:-1]}, \"choices\": ["


async def _stream(engine: EngineClient, sub: Submission, head: dict, include_usage: bool, opening: str,
                  on_delta, on_finish) -> AsyncGenerator[str, None]:
    """A streamed request's Server-Sent Events: `opening` (what comes before the engine's events, if anything);
    then per batch of the request's events (_batch: a handler that fell behind answers several steps in one
    write) the encoded chunks that on_delta(MergedDelta) and on_finish(Finished) return (lists), an engine
    failure as an error chunk; then the usage chunk (if asked for and every choice finished) and [DONE].
    Closed or cancelled before every choice finished (the client went away), it aborts the request."""
    outs, left = [], sub.num_choices  # left: choices not yet finished (none after a failure)
    first = True  # the first chunk with text is still to come (and timed)
    try:
        if opening:
            yield opening
        while left > 0:
            chunks = []
            for event in _merged(await _batch(engine, sub)):
                if isinstance(event, MergedDelta):
                    chunks += on_delta(event)
                    if first and event.text:
                        engine.metrics.http_ttft.observe(time.perf_counter() - sub.arrival)
                        first = False
                elif isinstance(event, Finished):
                    outs.append(event.output)
                    left -= 1
                    chunks += on_finish(event)
                elif isinstance(event, Failed):
                    left = 0
                    chunks.append(_data(APIError(503, event.message, type="server_error").body()))
            if chunks:
                yield "".join(chunks)
    finally:
        if left > 0:
            engine.abort(sub)
    if include_usage and len(outs) == sub.num_choices:
        yield _data({**head, "choices": [], "usage": _usage(sub, outs)})
    yield "data: [DONE]\n\n"


def _merged(events: list) -> list:
    """A batch of events with each run of one choice's Deltas joined into one (text joined; the tokens with
    logprobs as `pairs`): the handler sends one chunk for what the engine made in several steps."""
    out, runs = [], {}  # runs: choice -> its MergedDelta in `out` not yet followed by another event of it
    for event in events:
        if is_delta(event):
            index, text, token, logprobs = event
            run = runs.get(index)
            if run is None:
                run = runs[index] = MergedDelta(index, [], [])
                out.append(run)
            run.texts.append(text)
            if logprobs is not None:
                run.pairs.append((token, logprobs))
        else:
            runs.pop(getattr(event, "index", None), None)
            out.append(event)
    return out


@dataclass(slots=True)
class MergedDelta:
    index: int
    texts: list[str]
    pairs: list[tuple[int, dict]]   # (token, its logprobs entry) of the tokens that have one

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _stream_completion(engine: EngineClient, sub: Submission, head: dict, include_usage: bool,
                       echoes: list[str], top_n: int | None, tokenizer) -> AsyncGenerator[str, None]:
    prefix = _chunk_prefix(head)

    def choice(index: int, text: str, finish_reason=None, logprobs=None) -> str:
        # the encoded {"index", "text", "logprobs", "finish_reason"}, its values encoded one by one (_json)
        return (f'{prefix}{{"index": {index}, "text": {_json(text)}, "logprobs": {_json(logprobs)}, '
                f'"finish_reason": {_json(finish_reason)}}}]}}\n\n')

    offsets = [len(e) for e in echoes]  # text_offset of each choice's next token

    def on_delta(event: MergedDelta) -> list[str]:
        logprobs = None
        if event.pairs and top_n is not None:
            logprobs, offsets[event.index] = _completion_logprobs(event.pairs, tokenizer, top_n, offsets[event.index])
        text = event.text
        return [choice(event.index, text, logprobs=logprobs)] if text or logprobs is not None else []

    return _stream(engine, sub, head, include_usage, "".join(choice(i, echo) for i, echo in enumerate(echoes) if echo),
                   on_delta, lambda event: [choice(event.index, "", event.output.finish_reason)])


def _stream_chat(engine: EngineClient, sub: Submission, head: dict, include_usage: bool,
                 top_n: int | None, tokenizer, uses_tools: bool) -> AsyncGenerator[str, None]:
    prefix = _chunk_prefix(head)

    def choice(index: int, delta: dict, finish_reason=None, logprobs=None) -> str:
        # the encoded {"index", "delta", "logprobs", "finish_reason"}, its values encoded one by one (_json), the
        # delta's too (its keys are this function's callers' names, with nothing to escape)
        members = ", ".join([f'"{key}": {_json(value)}' for key, value in delta.items()])
        return (f'{prefix}{{"index": {index}, "delta": {{{members}}}, "logprobs": {_json(logprobs)}, '
                f'"finish_reason": {_json(finish_reason)}}}]}}\n\n')

    splits = [ReasoningStream() for _ in range(sub.num_choices)]
    calls = [tools.ToolCallStream() if uses_tools else None for _ in range(sub.num_choices)]
    num_calls = [0] * sub.num_choices

    def parts(index: int, reasoning: str, content: str, logprobs=None, last: bool = False):
        if reasoning:
            yield choice(index, {"reasoning_content": reasoning}, logprobs=logprobs)
            logprobs = None
        made = []
        if calls[index] is not None:
            content, made = calls[index].feed(content)
            content += calls[index].finish() if last else ""
        if content or logprobs is not None:
            yield choice(index, {"content": content} if content else {}, logprobs=logprobs)
        for call in made:
            yield choice(index, {"tool_calls": [call.as_dict(index=num_calls[index])]})
            num_calls[index] += 1

    def on_delta(event: MergedDelta) -> list[str]:
        logprobs = _chat_logprobs(event.pairs, tokenizer, top_n) if event.pairs and top_n is not None else None
        return list(parts(event.index, *splits[event.index].feed(event.text), logprobs))

    def on_finish(event: Finished) -> list[str]:
        chunks = list(parts(event.index, *splits[event.index].finish(), last=True))
        reason = "tool_calls" if num_calls[event.index] else event.output.finish_reason
        return chunks + [choice(event.index, {}, reason)]

    return _stream(engine, sub, head, include_usage,
                   "".join(choice(index, {"role": "assistant", "content": ""}) for index in range(sub.num_choices)),
                   on_delta, on_finish)


# ---------------------------------------------------------------------------- logprobs
def _pairs(out) -> list[tuple[int, dict[int, float]]]:
    """(token, its logprobs entry) of every generated token."""
    return list(zip(out.token_ids, out.logprobs or []))


LOGPROB_FLOOR = -9999.0  # what a response says for a logprob of -inf (a token of probability 0), as vLLM's does


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a token of probability 0 is given LOGPROB_FLOOR."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely tokens (the engine's entry lists them first, then the sampled one if it is not among them)."""
    return [(token, _finite(logprob)) for token, logprob in list(entry.items())[:n]]


def _completion_logprobs(pairs, tokenizer, n: int, at: int = 0) -> tuple[dict, int]:
    """The completions API's logprobs of these tokens, their text starting at offset `at`; and the offset after."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, entry in pairs:
        text = tokenizer.decode([token], skip_special_tokens=False)
        tokens.append(text)
        token_logprobs.append(_finite(entry[token]))
        top_logprobs.append({tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in _top(entry, n)})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, at


def _chat_logprobs(pairs, tokenizer, n: int) -> dict:
    def item(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {"content": [{**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, n)]}
                        for token, entry in pairs]}
