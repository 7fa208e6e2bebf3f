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

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..kv import Sequence
from ..kv.paged_cache import check_kv_quantize
from .speculative import (ModelDecoder, ModelDraft, Sampling, SpecStats, check_count, check_draft_model,
                          speculative_stream)
from ..model.tokenizer import CHAT_TEMPLATE
from .detokenize import IncrementalDetokenizer
from .generate import check_sampling
from .step import SamplingRow


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


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                enable_thinking: bool | None = None, **extra) -> str:
    """Render a Hugging Face chat template the way transformers does: jinja2 in an immutable
    sandbox, trim_blocks and lstrip_blocks, `raise_exception` available to the template."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    try:
        return env.from_string(template).render(**variables)
    except TemplateError as e:
        raise ValueError(f"the chat template failed to render: {e}") from None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChatSession:
    """A conversation with a loaded model (tileinfer.Model, or the model of an idle tileinfer.LLM).

        chat = ChatSession(model, system="You are terse.")
        reply = chat.send("Hello!", max_tokens=64)
        print(reply, chat.last_turn)
    """

    def __init__(self, model, *, max_context: int = 4096, kv_quantize: str | None = None, system: str | None = None,
                 on_overflow: str = "error", chat_template: str | None = None, kv_smoothing: bool = True,
                 draft_model=None, num_draft_tokens: int = 4):
        self.kv_quantize = "int8" if check_kv_quantize(kv_quantize) else None
        self.kv_smoothing = bool(kv_smoothing)
        check_count("num_draft_tokens", num_draft_tokens)
        self.num_draft_tokens = num_draft_tokens
        if on_overflow not in ("error", "drop_oldest"):
            raise ValueError(f"on_overflow must be 'error' or 'drop_oldest', got {on_overflow!r}")
        if hasattr(model, "scheduler"):  # an LLM: use its model and cache while it is idle
            if model.has_unfinished_requests():
                raise RuntimeError("the LLM has requests in flight; finish them before starting a chat on it")
            if max_context > model.max_context:
                raise ValueError(f"max_context {max_context} exceeds the LLM's max_context ({model.max_context}), "
                                 f"which sizes its block tables; create the LLM with a larger max_context")
            model = model.model
        self.model = model
        if draft_model is not None:
            check_draft_model(model, draft_model)
        self.draft_model = draft_model
        self._draft: ModelDraft | None = None  # the draft's own cached sequence, reused across turns
        limit = model.config.max_position_embeddings
        if not isinstance(max_context, int) or not 1 < max_context <= limit:
            raise ValueError(f"max_context must be an integer in 2..{limit} (the model's positions), got {max_context!r}")
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
        if self._draft is not None:
            decoder = self._draft.decoder
            if decoder.cache is self.draft_model.cache:
                decoder.release()
            self._draft = None

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
        return self.model.tokenizer.encode(text, add_special_tokens=False).ids

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
        check_sampling(temperature, top_k, top_p, max_tokens)
        messages = [dict(m) for m in self.messages] + [{"role": "user", "content": message}]
        ids, dropped = self._fit(messages, max_tokens, enable_thinking)
        return self._turn(messages, ids, dropped, max_tokens,
                          SamplingRow(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                                      seed=int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little")))

    def _turn(self, messages, ids, dropped, max_tokens, row) -> Iterator[str]:
        if self.draft_model is not None:
            yield from self._speculative_turn(messages, ids, dropped, max_tokens, row)
            return
        model = self.model
        cache, reused = self._keep_common_prefix(ids, self.max_context)
        manager, seq = cache.manager, self._seq
        start = time.perf_counter()
        detok = IncrementalDetokenizer(model.tokenizer)
        out: list[int] = []
        eos = set(model.eos_token_ids)
        completed = False
        try:
            chunk = model.max_batch_tokens
            pos = reused
            token = None
            while pos < len(ids):
                part = ids[pos:pos + chunk]
                manager.reserve(seq, len(part))
                last = pos + len(part) == len(ids)
                result = model.step([(seq, part, pos)], [row], sample=last)
                self._cached.extend(part)
                pos += len(part)
                if last:
                    token = int(result[0])
            prefill_done = time.perf_counter()
            while True:
                out.append(token)
                if token in eos:
                    break
                text = detok.add(token)
                if text:
                    yield text
                if len(out) >= max_tokens:
                    break
                manager.reserve(seq, 1)
                token = int(model.step([(seq, [token], len(self._cached))], [row])[0])
                self._cached.append(out[-1])
            completed = True
        finally:
            if not completed:  # abandoned or failed: keep the cache consistent with what it holds
                manager.truncate(seq, len(self._cached))
        end = time.perf_counter()
        self._finish_turn(messages, ids, out, reused, dropped, prefill_done - start, end - prefill_done)

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

    def _keep_common_prefix(self, ids: list[int], positions: int):
        """The model's cache (for at least `positions`), with the session's sequence cut back to its
        common prefix with `ids`, always leaving the last prompt token to compute (its logits start
        the reply). Returns (cache, positions reused)."""
        cache = self.model.ensure_cache(positions, kv_quantize=self.kv_quantize, smoothing=self.kv_smoothing)
        if self._cache is not cache:  # first turn, or the model's cache was replaced since
            self._seq, self._cache, self._cached = Sequence(), cache, []
        reused = min(common_prefix(self._cached, ids), len(ids) - 1)
        cache.manager.truncate(self._seq, reused)
        self._cached = self._cached[:reused]
        return cache, reused

    def _speculative_turn(self, messages, ids, dropped, max_tokens, row) -> Iterator[str]:
        """A turn with the draft model proposing (engine/speculative.py): both models keep their
        cached prefix of the conversation, and both caches end the turn holding only kept tokens."""
        model, k = self.model, self.num_draft_tokens
        room = self.max_context + k + 1  # a verify step feeds up to k + 1 positions past the committed ones
        cache, reused = self._keep_common_prefix(ids, room)
        draft_cache = self.draft_model.ensure_cache(room)
        if self._draft is None or self._draft.decoder.cache is not draft_cache:
            self._draft = ModelDraft(ModelDecoder(self.draft_model, draft_cache))
        target = ModelDecoder(model, cache, self._seq, self._cached)
        self._draft.rollback(ids)  # keep the draft's cached prefix of this prompt
        stats = SpecStats()
        detok = IncrementalDetokenizer(model.tokenizer)
        eos = set(model.eos_token_ids)
        out: list[int] = []
        start = time.perf_counter()
        try:
            for token in speculative_stream(target, self._draft, ids, max_new_tokens=max_tokens, num_draft_tokens=k,
                                            sampling=Sampling(row.temperature, row.top_k, row.top_p), seed=row.seed,
                                            eos_token_ids=eos, stats=stats):
                out.append(token)
                if token not in eos:
                    text = detok.add(token)
                    if text:
                        yield text
        finally:
            # Whatever happened, the session's record is what the target's sequence holds.
            self._cached = target.tokens
        end = time.perf_counter()
        self._finish_turn(messages, ids, out, reused, dropped, stats.prefill_seconds,
                          end - start - stats.prefill_seconds, stats)
