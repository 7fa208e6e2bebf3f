"""Single-sequence generation: prefill the prompt in chunks, then decode with a CUDA graph."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..kv import Sequence
from .model import Model
from .speculative import (ModelDecoder, ModelDraft, OracleDraft, Sampling, SpecStats, check_count,
                          check_draft_model, speculative_decode)
from .step import SamplingRow


@dataclass
class GenerationResult:
    token_ids: list[int]                  # the new tokens only
    text: str
    finish_reason: str                    # "stop" (an EOS token) or "length" (max_new_tokens)
    prompt_token_ids: list[int] = field(repr=False, default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    speculation: SpecStats | None = None  # with a draft model: drafted, accepted, target steps

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the decode steps (the first token comes from the prefill)."""
        steps = len(self.token_ids) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    """Raise ValueError naming the field and its allowed range."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def generate(model: Model, prompt: str | list[int], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
             on_token: Callable[[int], None] | None = None, kv_quantize: str | None = None,
             kv_smoothing: bool = True, draft_model=None, num_draft_tokens: int = 4) -> GenerationResult:
    """Continue `prompt` (text, or token ids) by up to `max_new_tokens` tokens, stopping at EOS.

    The KV cache is sized for the prompt plus the budget; kv_quantize="int8" makes it an INT8
    cache (int8 values + one float32 scale per vector, keys smoothed unless kv_smoothing=False).
    temperature 0 is greedy; otherwise sampling is seeded (a fresh random seed when `seed` is
    None) and reproducible for a seed. `on_token(token_id)` is called with each new token as soon
    as it is sampled (streaming).

    draft_model (a loaded Model with the same vocabulary, or an OracleDraft) turns on speculative
    decoding (engine/speculative.py): the draft proposes num_draft_tokens a round and this model
    checks them in one step. Greedy output is unchanged; sampled output keeps this model's
    distribution (though not its random stream). `result.speculation` holds the statistics.
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: give some text or token ids")
        ids = model.encode(prompt)
    else:
        ids = model._validate_ids(prompt)
    total = len(ids) + max_new_tokens
    limit = model.config.max_position_embeddings
    if total > limit:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                         f"model's context of {limit} positions; shorten the prompt or lower max_new_tokens")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    if draft_model is not None:
        return _speculative(model, ids, draft_model, num_draft_tokens, max_new_tokens, Sampling(
            float(temperature), int(top_k), float(top_p)), int(seed), stop_at_eos, on_token, kv_quantize)
    row = SamplingRow(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed))
    cache = model.ensure_cache(total, kv_quantize=kv_quantize, smoothing=kv_smoothing)
    seq = Sequence()
    out: list[int] = []
    finish = "length"
    try:
        start = time.perf_counter()
        chunk = model.max_batch_tokens
        for begin in range(0, len(ids), chunk):
            part = ids[begin: begin + chunk]
            cache.manager.reserve(seq, len(part))
            last = begin + chunk >= len(ids)
            next_ids = model.step([(seq, part)], [row], sample=last)
        token = int(next_ids[0])
        prefill_done = time.perf_counter()
        out.append(token)
        if on_token is not None:
            on_token(token)
        # Decode, pipelined: step t + 1 is launched before step t's token is read back, and takes that
        # token on the device (token_src), so the host's planning and the copies overlap the GPU's
        # work. If step t ends the generation (EOS), step t + 1 ran for nothing; the sequence is
        # released below either way.
        slot = None
        if len(out) < max_new_tokens and not (stop_at_eos and token in model.eos_token_ids):
            cache.manager.reserve(seq, 1)
            slot = model.launch([(seq, [token])], [row])
        while slot is not None:
            ahead = None
            if len(out) + 1 < max_new_tokens:
                cache.manager.reserve(seq, 1)
                ahead = model.launch([(seq, [0])], [row], token_src=[0])
            token = int(model.collect(slot, 1)[0])
            out.append(token)
            if on_token is not None:
                on_token(token)
            slot = ahead
            if stop_at_eos and token in model.eos_token_ids:
                if ahead is not None:
                    model.collect(ahead, 1)
                break
        end = time.perf_counter()
        if stop_at_eos and out[-1] in model.eos_token_ids:
            finish = "stop"
    finally:
        cache.manager.release(seq)
    return GenerationResult(token_ids=out, text=model.decode(out), finish_reason=finish, prompt_token_ids=ids,
                            prefill_seconds=prefill_done - start, decode_seconds=end - prefill_done)


def _speculative(model: Model, ids: list[int], draft_model, k: int, max_new_tokens: int, sampling: Sampling,
                 seed: int, stop_at_eos: bool, on_token, kv_quantize) -> GenerationResult:
    check_count("num_draft_tokens", k)
    total = len(ids) + max_new_tokens + k + 1  # a verify step feeds up to k + 1 positions past the committed ones
    limit = model.config.max_position_embeddings
    if total > limit:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) + num_draft_tokens + 1 = "
                         f"{total} exceeds the model's context of {limit} positions")
    target = ModelDecoder(model, model.ensure_cache(total, kv_quantize=kv_quantize))
    draft_decoder = None
    try:
        if isinstance(draft_model, OracleDraft):
            draft = draft_model
        elif isinstance(draft_model, Model):
            check_draft_model(model, draft_model)
            draft = ModelDraft(draft_decoder := ModelDecoder(draft_model, draft_model.ensure_cache(total)))
        else:
            raise TypeError(f"draft_model must be a loaded tileinfer.Model or an OracleDraft, got "
                            f"{type(draft_model).__name__}")
        start = time.perf_counter()
        out, stats = speculative_decode(target, draft, ids, max_new_tokens=max_new_tokens, num_draft_tokens=k,
                                        sampling=sampling, seed=seed,
                                        eos_token_ids=model.eos_token_ids if stop_at_eos else (),
                                        on_token=on_token)
        end = time.perf_counter()
    finally:
        target.release()
        if draft_decoder is not None:
            draft_decoder.release()
    finish = "stop" if stop_at_eos and out and out[-1] in model.eos_token_ids else "length"
    prefill = stats.prefill_seconds
    return GenerationResult(token_ids=out, text=model.decode(out), finish_reason=finish, prompt_token_ids=ids,
                            prefill_seconds=prefill, decode_seconds=end - start - prefill, speculation=stats)
