"""One sequence: `load_model` and `generate`, a single request through the engine loop.

    model = tileinfer.load_model("path/to/Qwen3-0.6B")              # or device="cpu"
    result = tileinfer.generate(model, "The capital of France is", max_new_tokens=32)

`load_model` returns a runner (runner/gpu.py, or runner/cpu.py for device="cpu") whose KV cache is
sized on demand: `generate` makes it hold the prompt plus the budget, then runs the request through an
Engine over that runner, exactly as `LLM.generate` runs a batch (pipelined decode steps replaying the
batch-1 graph, stops, speculation with a draft model).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .config import DEFAULT_DRAFT_TOKENS, EngineConfig, check_count, parse_device
from .engine.engine import Engine
from .engine.params import SamplingParams
from .engine.scheduler import FINISHED
from .engine.speculative import OracleDraft, SpecStats, default_draft_tokens, make_drafter
from .llm import LLM
from .model.dflash_config import is_dflash_dir
from .runner.cpu import CPURunner
from .runner.cpu_dflash import CPUDFlashRunner
from .runner.gpu import GPURunner
from .runner.gpu_dflash import GPUDFlashRunner


def load_model(path: str | Path, *, device="cuda", max_num_seqs: int = 8, max_batch_tokens: int = 2048,
               max_logit_rows: int = 256, batch_invariant: bool = False, progress: bool = True):
    """A Hugging Face Qwen3 checkpoint directory loaded for one (or a few) sequences: bf16 weights on the GPU
    (device="cuda" or "cuda:N"), or float32 numpy weights for the CPU runner (device="cpu"), which also runs
    Apertus checkpoints. A DFlash drafter's directory loads as a drafter, a draft_model for `generate` and
    `ChatSession` beside a model loaded on the same device (its weights go up when it is paired)."""
    kind, ordinal = parse_device(device)
    if is_dflash_dir(path):  # drafts for the model it is passed beside (generate's draft_model)
        if kind == "cpu":
            return CPUDFlashRunner(path, max_num_seqs=max_num_seqs)
        return GPUDFlashRunner(path, max_num_seqs=max_num_seqs)
    if kind == "cpu":
        return CPURunner(path, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                         max_logit_rows=max_logit_rows)
    return GPURunner(path, device=ordinal, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                     max_logit_rows=max_logit_rows, batch_invariant=batch_invariant, progress=progress)


def draft_tokens(draft, num_draft_tokens: int | None) -> int:
    """A round's proposals: as asked, else the drafter's default (a DFlash drafter's block_size - 1, else 4)."""
    if num_draft_tokens is not None:
        check_count("num_draft_tokens", num_draft_tokens)
        return num_draft_tokens
    return DEFAULT_DRAFT_TOKENS if draft is None else default_draft_tokens(draft)


def engine_over(runner, positions: int, *, kv_quantize: str | None = None, kv_smoothing: bool = True,
                draft=None, num_draft_tokens: int | None = None) -> Engine:
    """An Engine over a loaded runner whose cache holds at least `positions` (resized if it does not).
    draft: a loaded runner of the same tokenizer (its own cache, sized alike), a loaded DFlash drafter
    (load_model of its directory, on the runner's device) or an OracleDraft."""
    cache = runner.ensure_cache(positions, kv_quantize=kv_quantize, smoothing=kv_smoothing)
    num_draft_tokens = draft_tokens(draft, num_draft_tokens)
    drafter = None
    if isinstance(draft, OracleDraft):
        drafter = draft
    elif draft is not None:
        if draft is runner:
            raise ValueError("draft_model is the target model itself; load a second, smaller model (generate also "
                             "takes an OracleDraft)")
        if draft.config.vocab_size != runner.config.vocab_size:
            raise ValueError(f"draft_model's vocabulary ({draft.config.vocab_size}) differs from the target's "
                             f"({runner.config.vocab_size}); speculation needs the same tokenizer")
        drafter = make_drafter(draft, runner, num_draft_tokens)  # (a DFlash drafter is paired with runner here)
        draft.ensure_cache(positions)
    config = EngineConfig(model=runner.checkpoint.path, device="cpu" if isinstance(runner, CPURunner) else "cuda",
                          max_num_seqs=runner.max_num_seqs, max_context=min(positions, cache.capacity),
                          max_num_batched_tokens=runner.max_batch_tokens, page_size=cache.manager.page_size,
                          batch_invariant=bool(getattr(runner, "batch_invariant", False)),
                          use_graphs=runner.use_graphs, num_draft_tokens=num_draft_tokens,
                          draft_model=runner.checkpoint.path if drafter is not None else None)
    return Engine(config, runner, runner.tokenizer, runner.eos_token_ids, drafter)


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


def generate(model, prompt: str | list[int], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
             on_token: Callable[[int], None] | None = None, kv_quantize: str | None = None,
             kv_smoothing: bool = True, draft_model=None, num_draft_tokens: int | None = None) -> GenerationResult:
    """Continue `prompt` (text, or token ids) by up to `max_new_tokens` tokens, stopping at EOS.

    model: a loaded runner (`load_model`), whose KV cache is sized for the prompt plus the budget
    (kv_quantize="int8" makes it an INT8 cache, keys smoothed unless kv_smoothing=False); or an idle `LLM`,
    whose engine and pool run the request (its cache, draft model and tensor parallelism are the LLM's own:
    pass them when creating it, not here). temperature 0
    is greedy; otherwise sampling is seeded (a fresh random seed when `seed` is None) and reproducible
    for a seed. `on_token(token_id)` is called with each new token as soon as it is read back.

    draft_model (a second loaded runner with the same vocabulary, a loaded DFlash drafter, or an OracleDraft)
    turns on speculative decoding (engine/speculative.py): greedy output is unchanged; sampled output keeps
    this model's distribution. num_draft_tokens: proposals a round (default: 4; a DFlash drafter's
    block_size - 1). `result.speculation` holds the statistics.
    """
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, ignore_eos=not stop_at_eos)
    if isinstance(prompt, str) and not prompt:
        raise ValueError("prompt is empty: give some text or token ids")
    if isinstance(model, LLM):
        engine = _llm_engine(model, kv_quantize=kv_quantize, draft_model=draft_model, num_draft_tokens=num_draft_tokens)
        ids, _ = engine.prompt_ids(prompt)
        req = engine.make_request(ids, params)  # checks the prompt and max_new_tokens fit the LLM's max_context
    else:
        ids = model.encode(prompt) if isinstance(prompt, str) else model.validate_ids(prompt)
        num_draft_tokens = draft_tokens(draft_model, num_draft_tokens)
        extra = num_draft_tokens + 1 if draft_model is not None else 0  # a verify step feeds k + 1 positions
        total = len(ids) + max_new_tokens + extra
        limit = model.config.max_position_embeddings
        if total > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens})"
                             f"{' + num_draft_tokens + 1' if extra else ''} = {total} exceeds the model's context of "
                             f"{limit} positions; shorten the prompt or lower max_new_tokens")
        engine = engine_over(model, total, kv_quantize=kv_quantize, kv_smoothing=kv_smoothing, draft=draft_model,
                             num_draft_tokens=num_draft_tokens)
        req = engine.make_request(ids, params)
    start = time.perf_counter()
    engine.add(req)
    try:
        while req.status != FINISHED or req.unresolved:
            for r, token, _ in engine.step():
                if on_token is not None:
                    on_token(token)
    except BaseException:
        engine.abort(req)
        raise
    finally:
        engine.drain()
    out = engine.output(req)
    first = req.first_token_time or start
    return GenerationResult(token_ids=out.token_ids, text=out.text, finish_reason=out.finish_reason,
                            prompt_token_ids=ids, prefill_seconds=first - start,
                            decode_seconds=(req.finish_time or first) - first, speculation=out.speculation)


def _llm_engine(llm: LLM, *, kv_quantize, draft_model, num_draft_tokens) -> Engine:
    """An idle LLM's engine for generate(); ValueError for the options an LLM takes when it is created."""
    given = [name for name, value in (("kv_quantize", kv_quantize), ("draft_model", draft_model),
                                      ("num_draft_tokens", num_draft_tokens)) if value is not None]
    if given:
        raise ValueError(f"generate() over an LLM runs with the LLM's own cache and draft model: pass "
                         f"{', '.join(given)} to LLM(...) instead")
    llm._check_open()
    if llm.has_unfinished_requests():
        raise RuntimeError("the LLM has requests in flight; finish them before calling generate() on it")
    return llm.engine
