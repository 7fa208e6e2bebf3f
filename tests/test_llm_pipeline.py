"""The LLM's step pipeline on the CPU, with a fake model in place of the GPU.

The fake model's next token depends only on (fed token, position), so every request's output is
known in advance. It honours token_src exactly as the device does (a decode token taken from the
previous launched step's samples), and it checks that every token the host feeds is real (no
placeholder). Outputs must be the same pipelined or not, with stops, preemption and prefix
caching in play.
"""
from __future__ import annotations

import numpy as np
import pytest
import tokenizers

from tileinfer.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.engine.params import SamplingParams
from tileinfer.kv import BlockManager
from tileinfer.llm import LLM
from tileinfer.model import tokenizer as tok

VOCAB = 1000


def next_token(token: int, position: int) -> int:
    return (token * 7919 + position * 104729 + 13) % VOCAB


class FakeModel:
    use_graphs = False

    def __init__(self, manager: BlockManager, budget: int):
        self.cache = type("Cache", (), {"manager": manager})()
        self.max_batch_tokens = budget
        self.config = type("C", (), {"vocab_size": VOCAB})()
        self.prev = np.zeros(0, np.int32)   # samples of the last launched step that sampled
        self.pending: dict[int, np.ndarray] = {}
        self.slot = 0

    def launch(self, batch, sampling=None, *, sample=True, penalties=None, masked=None, token_src=None):
        out = np.zeros(len(batch), np.int32)
        for i, (seq, ids, start) in enumerate(batch):
            ids = list(ids)
            if token_src is not None and token_src[i] >= 0:
                assert len(ids) == 1
                ids = [int(self.prev[token_src[i]])]
            assert all(t >= 0 for t in ids), "the host fed a placeholder"
            assert seq.num_positions >= start + len(ids)
            out[i] = next_token(ids[-1], start + len(ids) - 1)
        if not sample:
            return None
        self.prev = out
        slot, self.slot = self.slot, self.slot ^ 1
        self.pending[slot] = out
        return slot

    def collect(self, slot, n):
        return None if slot is None else self.pending.pop(slot)[:n]

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]


def fake_llm(*, num_pages=64, page_size=4, max_num_seqs=4, budget=16, async_scheduling=True, prefix=True):
    """An LLM whose engine runs the fake model (the LLM's start-up, which loads a checkpoint, is skipped)."""
    config = EngineConfig(model="unused", max_num_seqs=max_num_seqs, max_context=256, page_size=page_size,
                          max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    manager = BlockManager(num_pages, page_size, enable_prefix_caching=prefix)
    tokenizer = tokenizers.Tokenizer.from_str(tok.qwen3_tokenizer_json())
    llm = LLM.__new__(LLM)
    llm.config, llm._requests, llm._closed, llm._started = config, {}, False, None
    llm.runner, llm.tokenizer, llm.eos_token_ids = FakeModel(manager, budget), tokenizer, {VOCAB - 1}
    llm.engine = Engine(config, llm.runner, tokenizer, llm.eos_token_ids)
    llm.engine.scheduler.watermark_pages = 0
    llm.scheduler, llm.model = llm.engine.scheduler, llm.runner  # what the tests look at
    return llm


def expected(prompt, params: SamplingParams) -> list[int]:
    tokens = list(prompt)
    out = []
    while len(out) < params.max_tokens:
        t = next_token(tokens[-1], len(tokens) - 1)
        tokens.append(t)
        out.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t == VOCAB - 1):
            break
    return out


def workload(seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB - 1, int(n)).tolist() for n in rng.integers(1, 40, 10)]
    params = []
    for _ in prompts:
        m = int(rng.integers(1, 30))
        stops = [int(t) for t in rng.integers(0, VOCAB, 30)]  # often hit: ends requests at unknown steps
        params.append(SamplingParams(max_tokens=m, temperature=0, stop_token_ids=stops, ignore_eos=True))
    return prompts, params


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("num_pages", [64, 18])
def test_pipelined_steps_give_the_expected_tokens(seed, pipelined, num_pages):
    prompts, params = workload(seed)
    llm = fake_llm(num_pages=num_pages, async_scheduling=pipelined)
    outs = llm.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        want = expected(p, sp)
        assert o.token_ids == want
        assert o.finish_reason == ("stop" if want[-1] in sp.stop_token_ids else "length")
    assert llm.scheduler.manager.num_free_pages == num_pages
    assert llm.engine._inflight is None or not llm.scheduler.has_unfinished
    if num_pages == 18:
        assert llm.scheduler.num_preemptions > 0  # the tight pool preempts on every one of these workloads


@pytest.mark.parametrize("pipelined", [True, False])
def test_stats_split_steps_into_decode_and_prompt_chunks(pipelined):
    # Two prompts of 10 tokens, 5 new tokens each, a 16-token budget: step 1 runs A's prompt and 6 of
    # B's tokens (A's first token); step 2 B's last 4 and A's second token (B's first); then decode
    # steps make A's last 3 and B's last 4: 7 decode rows. Each iteration's time goes to the step
    # it finished.
    llm = fake_llm(async_scheduling=pipelined)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm.generate([list(range(1, 11)), list(range(11, 21))], params)
    st = llm.stats
    assert st.steps - st.decode_steps == 2 and st.generated_tokens == 10
    assert st.decode_rows == 7 and st.prefill_tokens == st.prompt_tokens == 20
    # A's decode rows feed positions 11, 12, 13 (reading 12, 13, 14), B's 10-13 (reading 11-14)
    assert st.decode_positions == 12 + 13 + 14 + 11 + 12 + 13 + 14
    assert st.decode_rows <= 2 * st.decode_steps
    assert 0 < st.decode_seconds < st.step_seconds


def test_stream_and_step_api_with_pipelining():
    prompts, params = workload(100)
    llm = fake_llm()
    got = [[] for _ in prompts]
    for ev in llm.generate_stream(prompts, params):
        got[ev.index] += ev.token_ids
    assert got == [expected(p, sp) for p, sp in zip(prompts, params)]
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    while llm.has_unfinished_requests():
        llm.step()
    outs = {o.request_id: o for o in llm.finished_outputs()}
    assert [outs[i].token_ids for i in ids] == got


def test_stream_closed_early_leaves_nothing_behind():
    prompts, params = workload(200)
    llm = fake_llm()
    gen = llm.generate_stream(prompts, [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * len(prompts))
    next(gen)
    gen.close()
    assert not llm.scheduler.has_unfinished
    outs = llm.generate(prompts[:2], params[:2])  # the engine goes on; the dropped step's results are ignored
    assert [o.token_ids for o in outs] == [expected(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    assert llm.scheduler.manager.num_free_pages == 64


def test_abort_request_ends_it_with_the_tokens_read_back():
    prompts, params = workload(250)
    llm = fake_llm()
    ids = [llm.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for p in prompts[:3]]
    for _ in range(5):
        llm.step()
    assert llm.engine._inflight is not None  # a step in flight holds a placeholder of the request aborted
    llm.abort_request(ids[1])
    llm.abort_request(10**6)  # unknown: nothing happens
    while llm.has_unfinished_requests():
        llm.step()
    outs = {o.request_id: o for o in llm.finished_outputs()}
    full = [expected(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for p in prompts[:3]]
    aborted = outs[ids[1]]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 20
    assert aborted.token_ids == full[1][:len(aborted.token_ids)]  # read back, no placeholder
    assert [outs[ids[0]].token_ids, outs[ids[2]].token_ids] == [full[0], full[2]]
    assert llm.scheduler.manager.num_free_pages == 64


def test_bad_requests_are_refused_and_the_engine_keeps_serving():
    prompts, params = workload(300)
    llm = fake_llm()
    with pytest.raises(ValueError, match="prompt 1 is not valid UTF-8"):
        llm.generate(["fine", b"\xff\xfe broken"], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match=r"prompt 1 holds a lone UTF-16 surrogate \(U\+DC00 at character 2\)"):
        llm.generate(["fine", "ab\udc00"], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2], [VOCAB + 5]], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match="max_context"):
        llm.generate([[1] * 250], SamplingParams(max_tokens=10, temperature=0))
    assert not llm.scheduler.has_unfinished  # nothing of a refused batch was queued
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [expected(p, sp) for p, sp in zip(prompts, params)]
    assert llm.generate([b"bytes are text"], SamplingParams(max_tokens=2, temperature=0))[0].prompt == "bytes are text"


def test_a_gpu_error_stops_the_engine_with_a_clear_message():
    from tileinfer.cuda import CudaError

    llm = fake_llm()
    real_collect = llm.model.collect

    def failing_collect(slot, n):
        raise CudaError("cuEventSynchronize", "CUDA_ERROR_ILLEGAL_ADDRESS", "in kernel gemm_swap_b32_w1_c4")

    llm.model.collect = failing_collect
    with pytest.raises(CudaError):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))
    llm.model.collect = real_collect
    with pytest.raises(RuntimeError, match="stopped after a GPU error .*ILLEGAL_ADDRESS.* create a new one"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))


def test_soak_many_requests_through_a_small_pool():
    """2,000 requests of random lengths through a pool that forces preemption: every request
    finishes with its expected tokens, every page comes back, the engine's host memory does not
    grow from batch to batch, and a re-run gives the same outputs."""
    import tracemalloc

    rng = np.random.default_rng(7)
    n, batch = 2_000, 400
    prompts = [rng.integers(0, VOCAB - 1, int(k)).tolist() for k in rng.integers(1, 60, n)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True,
                             stop_token_ids=[int(rng.integers(0, VOCAB))]) for m in rng.integers(1, 40, n)]
    want = [expected(p, sp) for p, sp in zip(prompts, params)]
    tracemalloc.start()
    try:
        llm = fake_llm(num_pages=40, max_num_seqs=16, budget=64)
        held = []
        for i, start in enumerate(range(0, n, batch)):  # batches arrive while the engine keeps its state
            outs = llm.generate(prompts[start:start + batch], params[start:start + batch])
            assert [o.token_ids for o in outs] == want[start:start + batch]
            del outs
            held.append(tracemalloc.get_traced_memory()[0])
        assert llm.scheduler.manager.num_free_pages == 40
        assert llm.scheduler.num_preemptions > 0
        growth = held[-1] - held[1]
        assert growth < 1_000_000, f"host memory grew by {growth} bytes over {n - 2 * batch} requests"
    finally:
        tracemalloc.stop()
    again = fake_llm(num_pages=40, max_num_seqs=16, budget=64).generate(prompts[:batch], params[:batch])
    assert [o.token_ids for o in again] == want[:batch]
