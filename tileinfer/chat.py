"""ChatSession: one conversation on one cached sequence, re-using the cache's common prefix.

Each turn renders the whole conversation with the checkpoint's own chat template (jinja2, in a
sandbox, as Hugging Face renders it), tokenizes it, and compares it with the tokens already in
the cache. The sequence is truncated to the longest common prefix (a host-side list operation)
and only the rest is prefilled. Usually that prefix is everything up to the new user message,
so a turn costs about as much as its own tokens.

Templates may rewrite history: Qwen3's drops the <think>...</think> block of earlier assistant
turns, so after a reasoning reply the common prefix ends where that reply started and the reply
is prefilled again without its reasoning. The session follows the template rather than keeping
tokens the model was never trained to see. Editing `session.messages` works the same way: the
next turn re-prefills from the first token that changed.

When a turn would not fit in `max_context` (the rendered conversation plus max_tokens), the
session raises ContextFullError, or with on_overflow="drop_oldest" drops the oldest
user/assistant turns (the system message stays) until it fits. Nothing is ever cut silently.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from .engine.engine import Engine
from .engine.params import SamplingParams
from .engine.scheduler import FINISHED
from .engine.speculative import SpecStats
from .generate import draft_tokens, engine_over
from .kv import Sequence
from .kv.paged_cache import check_kv_quantize
from .llm import LLM
from .model.chat_template import render_chat
from .model.tokenizer import CHAT_TEMPLATE, encode_text


DEFAULT_MAX_CONTEXT = 4096  # a chat's positions when neither the caller nor an LLM says


class ContextFullError(ValueError):
    """The conversation plus the reply budget does not fit in the session's max_context."""


@dataclass
class TurnStats:
    prompt_tokens: int       # the rendered conversation, this turn
    reused_tokens: int       # of those, already in the cache
    computed_tokens: int     # prefilled this turn (prompt_tokens - reused_tokens)
    new_tokens: int          # generated
    prefill_seconds: float
    decode_seconds: float
    dropped_turns: int = 0   # oldest turns dropped to fit (on_overflow="drop_oldest")
    token_ids: list[int] | None = None  # the reply's tokens (with the end-of-turn token, if one came)
    speculation: SpecStats | None = None  # with a draft model: drafted, accepted, target steps

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.new_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChatSession:
    """A conversation with a loaded model (a runner from `load_model`, or an idle `LLM`).

        chat = ChatSession(model, system="You are terse.")
        reply = chat.send("Hello!", max_tokens=64)
        print(reply, chat.last_turn)

    Each turn is one request through the engine loop, holding the session's sequence: the engine admits
    it onto the positions the sequence keeps (the common prefix), computes the rest, and leaves the
    sequence cut to the known tokens when the reply ends.
    """

    def __init__(self, model, *, max_context: int | None = None, kv_quantize: str | None = None,
                 system: str | None = None, on_overflow: str = "error", chat_template: str | None = None,
                 kv_smoothing: bool = True, draft_model=None, num_draft_tokens: int | None = None):
        self.kv_quantize = "int8" if check_kv_quantize(kv_quantize) else None
        self.kv_smoothing = bool(kv_smoothing)
        self.num_draft_tokens = draft_tokens(draft_model, num_draft_tokens)
        if on_overflow not in ("error", "drop_oldest"):
            raise ValueError(f"on_overflow must be 'error' or 'drop_oldest', got {on_overflow!r}")
        self.llm = model if isinstance(model, LLM) else None
        if self.llm is not None:  # use its engine and pool while it is idle
            if self.llm.has_unfinished_requests():
                raise RuntimeError("the LLM has requests in flight; finish them before starting a chat on it")
            if max_context is None:
                max_context = self.llm.config.max_context
            if max_context > self.llm.config.max_context:
                raise ValueError(f"max_context {max_context} exceeds the LLM's max_context "
                                 f"({self.llm.config.max_context}), which sizes its block tables; create the LLM "
                                 f"with a larger max_context")
            model = self.llm.runner
        self.model = model
        self.draft_model = draft_model
        limit = model.config.max_position_embeddings
        if max_context is None:
            max_context = min(DEFAULT_MAX_CONTEXT, limit)
        if not isinstance(max_context, int) or isinstance(max_context, bool) or not 1 < max_context <= limit:
            raise ValueError(f"max_context must be an integer in 2..{limit} (the model's positions), "
                             f"got {max_context!r}")
        self.max_context = max_context
        self.on_overflow = on_overflow
        self.template = chat_template or model.checkpoint.chat_template or CHAT_TEMPLATE
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.last_turn: TurnStats | None = None
        self._seq: Sequence | None = None
        self._cache = None
        self._cached: list[int] = []   # the tokens whose keys and values the sequence holds

    # ------------------------------------------------------------------ history
    def reset(self) -> None:
        """Forget the conversation (the system message stays) and the cached tokens."""
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
        self._release()

    def _release(self) -> None:
        if self._seq is not None and self._cache is not None and self._cache is self.model.cache:
            self._cache.manager.release(self._seq)
        self._seq, self._cache, self._cached = None, None, []

    def close(self) -> None:
        self._release()

    def __enter__(self) -> "ChatSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def render(self, messages: list[dict] | None = None, enable_thinking: bool | None = None) -> list[int]:
        """The token ids of the conversation (with a generation prompt), as the next turn would see them."""
        text = render_chat(self.template, self.messages if messages is None else messages,
                           enable_thinking=enable_thinking)
        return encode_text(self.model.tokenizer, text, "the conversation")

    def _fit(self, messages: list[dict], max_tokens: int, enable_thinking) -> tuple[list[int], int]:
        ids = self.render(messages, enable_thinking)
        dropped = 0
        while len(ids) + max_tokens > self.max_context:
            first = 1 if messages and messages[0]["role"] == "system" else 0
            if self.on_overflow != "drop_oldest" or len(messages) - first <= 1:
                raise ContextFullError(
                    f"the conversation ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds max_context "
                    f"({self.max_context}); start a new session (reset()), lower max_tokens, raise max_context, or "
                    f"create the session with on_overflow='drop_oldest'")
            # Drop the oldest turn: a user message and the assistant reply after it.
            del messages[first]
            if len(messages) > first + 1 and messages[first]["role"] == "assistant":
                del messages[first]
            dropped += 1
            ids = self.render(messages, enable_thinking)
        return ids, dropped

    # ------------------------------------------------------------------ turns
    def send(self, message: str, **sampling) -> str:
        """Add a user message, generate the reply, add it to the history; returns the reply text."""
        return "".join(self.stream(message, **sampling))

    def stream(self, message: str, *, max_tokens: int = 512, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, enable_thinking: bool | None = None) -> Iterator[str]:
        """Like send, but yields the reply's text as it is generated. The turn is added to the history
        when the generator finishes (an abandoned turn leaves the history as it was)."""
        if not isinstance(message, str) or not message:
            raise ValueError("message must be a non-empty string")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        messages = [dict(m) for m in self.messages] + [{"role": "user", "content": message}]
        ids, dropped = self._fit(messages, max_tokens, enable_thinking)
        return self._turn(messages, ids, dropped, params)

    def _engine(self) -> Engine:
        """The engine of this turn: the LLM's, or one over the model whose cache holds max_context (and a
        verify step's positions past it when speculating). A new cache means the held sequence is gone."""
        if self.llm is not None:
            engine = self.llm.engine
        else:
            room = self.max_context + (self.num_draft_tokens + 1 if self.draft_model is not None else 0)
            engine = engine_over(self.model, room, kv_quantize=self.kv_quantize, kv_smoothing=self.kv_smoothing,
                                 draft=self.draft_model, num_draft_tokens=self.num_draft_tokens)
        if self._cache is not self.model.cache:  # first turn, or the model's cache was replaced since
            self._seq, self._cache, self._cached = Sequence(), self.model.cache, []
        return engine

    def _turn(self, messages, ids, dropped, params: SamplingParams) -> Iterator[str]:
        engine = self._engine()
        # Keep the common prefix, at least the prompt's last token to compute (its logits start the reply).
        reused = min(common_prefix(self._cached, ids), len(ids) - 1)
        if self._seq.num_positions:
            self._cache.manager.truncate(self._seq, min(reused, self._seq.num_positions))
        req = engine.make_request(ids, params, seq=self._seq, keep_seq=True)
        start = time.perf_counter()
        engine.add(req, stream=True)
        completed = False
        try:
            while req.status != FINISHED or req.unresolved:
                for r, token, _ in engine.step():
                    text = r.detokenizer.stream_delta(r.status == FINISHED and not r.unresolved)
                    if text:
                        yield text
            completed = True
        finally:
            if not completed:  # abandoned or failed: the request ends, the sequence keeps what is known
                engine.abort(req)
            engine.drain()
            if self._seq.num_positions:
                self._cache.manager.truncate(self._seq, req.known_positions())
            self._cached = req.token_ids[:self._seq.num_positions]
        first = req.first_token_time or start
        self._finish_turn(messages, ids, req.output_ids, req.num_cached_tokens, dropped, first - start,
                          (req.finish_time or first) - first, req.spec)

    def _finish_turn(self, messages, ids, out, reused, dropped, prefill_seconds, decode_seconds,
                     speculation: SpecStats | None = None) -> None:
        eos = set(self.model.eos_token_ids)
        reply = self.model.tokenizer.decode([t for t in out if t not in eos], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        self.messages = messages
        self.last_turn = TurnStats(prompt_tokens=len(ids), reused_tokens=reused, computed_tokens=len(ids) - reused,
                                   new_tokens=len(out), prefill_seconds=prefill_seconds,
                                   decode_seconds=decode_seconds, dropped_turns=dropped, token_ids=out,
                                   speculation=speculation)
