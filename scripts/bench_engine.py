"""Engine benchmarks (tileinfer.LLM), used by scripts/bench.py --engine.

  batch decode   B requests of a `context`-token prompt decode `new` tokens together (greedy,
                 ignore_eos); tokens/s in total over the steps in which all B decode together.
  offline        256 requests, prompt and output lengths uniform in 100..1024 (seed 0),
                 ignore_eos; output tokens/s over the whole run (prefill included).
  shared prefix  64 requests sharing a 2,000-token prefix (+ 16 tokens of their own), one new token
                 each, with prefix caching on and off: prompt tokens computed and seconds.
"""
from __future__ import annotations

import time

import numpy as np

from tileinfer import LLM, SamplingParams

VOCAB = 151643  # ordinary-text ids of Qwen3's tokenizer; a smaller vocabulary (Apertus') caps it: vocab()


def vocab(llm: LLM) -> int:
    """The ids random prompts are drawn from: [0, vocab(llm))."""
    return min(VOCAB, llm.runner.config.vocab_size)


def batch_decode(llm: LLM, batch: int, context: int, new: int, params: list[SamplingParams] | None = None) -> dict:
    """Steady-state decode: tokens/s over the steps in which all `batch` requests decode together
    (prompts are admitted over several steps, so the first and last steps run fewer rows). params: each
    request's (default greedy, ignore_eos); every request must run to max_tokens = `new`."""
    rng = np.random.default_rng(batch)
    params = params or [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)] * batch
    ids = [llm.add_request(rng.integers(0, vocab(llm), context).tolist(), p) for p in params]
    full_steps, t_first, t_last = 0, None, None
    while llm.has_unfinished_requests():
        llm.step()
        launched = llm.engine._inflight.rows if llm.engine._inflight is not None else []
        now = time.perf_counter()
        if len(launched) == batch and all(r.count == 1 for r in launched):
            if t_first is None:
                t_first, wait0, grammar0 = now, llm.runner.wait_seconds, llm.stats.grammar_seconds
            else:
                full_steps += 1
                t_last, wait1, grammar1 = now, llm.runner.wait_seconds, llm.stats.grammar_seconds
    outs = llm.finished_outputs()
    short = [(o.request_id, len(o.token_ids), o.finish_reason) for o in outs if len(o.token_ids) != new]
    assert sorted(o.request_id for o in outs) == sorted(ids) and not short, f"ended before {new} tokens: {short}"
    dt = t_last - t_first
    return dict(batch=batch, context=context, new=new, decode_tok_s=batch * full_steps / dt, steps=full_steps,
                ms_per_step=dt / full_steps * 1e3, gpu_wait_ms_per_step=(wait1 - wait0) / full_steps * 1e3,
                grammar_ms_per_step=(grammar1 - grammar0) / full_steps * 1e3)


def live_step(llm: LLM, batch: int, context: int, inspect):
    """`inspect(model, batch)` over a live decode step of `batch` requests: they are brought to
    steady decode (every one has two tokens and the step in flight decodes all of them), that step
    is waited for, and inspect runs over its step buffers (their block tables and lengths are the
    requests', with their pages still held: a profile replaying the step reads the real cache). The
    requests are aborted afterwards (a replay rewrites their newest cache slots). Returns inspect's
    result."""
    rng = np.random.default_rng(batch + 1)
    prompts = [rng.integers(0, vocab(llm), context).tolist() for _ in range(batch)]
    counts = [0] * batch
    # The first prompts decode a token a step while the rest are prefilled: enough tokens to outlast that.
    prefill_steps = -(-batch * context // llm.engine.scheduler.max_num_batched_tokens)
    stream = llm.generate_stream(prompts, SamplingParams(max_tokens=prefill_steps + 32, temperature=0, ignore_eos=True))
    try:
        for out in stream:
            counts[out.index] += len(out.token_ids)
            step = llm.engine._inflight
            if min(counts) >= 2 and step is not None and len(step.rows) == batch and \
                    all(r.count == 1 for r in step.rows):
                llm.runner.stream.synchronize()
                return inspect(llm.runner, batch)
        raise RuntimeError(f"the {batch} requests finished before all of them decoded together")
    finally:
        stream.close()


def offline(llm: LLM, n: int = 256, low: int = 100, high: int = 1024, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ins = rng.integers(low, high + 1, n)
    outs_len = rng.integers(low, high + 1, n)
    prompts = [rng.integers(0, vocab(llm), int(k)).tolist() for k in ins]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in outs_len]
    s0 = dict(llm.stats.as_dict())
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == int(outs_len.sum())
    d = {k: v - s0[k] for k, v in llm.stats.as_dict().items()}
    # Where the time went: the iterations that finished a decode step (one token per row) against
    # those that finished a step with prompt chunks, and generate's own work outside the steps.
    return dict(requests=n, prompt_tokens=int(ins.sum()), output_tokens=generated, seconds=dt,
                output_tok_s=generated / dt, total_tok_s=(generated + int(ins.sum())) / dt,
                steps=d["steps"], preemptions=d["preemptions"], decode_steps=d["decode_steps"],
                decode_rows=d["decode_rows"], decode_positions=d["decode_positions"], decode_seconds=d["decode_seconds"],
                prefill_steps=d["steps"] - d["decode_steps"], prefill_step_seconds=d["step_seconds"] - d["decode_seconds"],
                outside_step_seconds=dt - d["step_seconds"], prefill_tokens=d["prefill_tokens"])


def shared_prefix(llm: LLM, n: int = 64, prefix: int = 2000, own: int = 16, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab(llm), prefix).tolist()
    prompts = [shared + rng.integers(0, vocab(llm), own).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    p0 = llm.stats.prefill_tokens
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dict(requests=n, prompt_tokens=n * (prefix + own), computed_prompt_tokens=llm.stats.prefill_tokens - p0,
                cached_tokens=sum(o.num_cached_tokens for o in outs), seconds=dt,
                first_tokens=[o.token_ids[0] for o in outs])
