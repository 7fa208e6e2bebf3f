"""The continuous-batching scheduler on the CPU, against a fake model.

The fake model's next token is a function of the whole token history, so a request's output is
fixed by its prompt alone. Every schedule is checked for the rules the engine relies on (token
budget, row limit, contiguous chunks, reserved positions), and the outputs must not depend on
the pool size (preemption and recompute), on prefix caching, or on the other requests.
"""
from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileinfer.engine.params import SamplingParams
from tileinfer.engine.scheduler import FINISHED, RUNNING, Request, Scheduler
from tileinfer.kv import BlockManager

VOCAB = 50


def fake_next(tokens: list[int]) -> int:
    return zlib.crc32(bytes(str(tokens[-8:]) + str(len(tokens)), "ascii")) % VOCAB


def run(prompts, max_tokens, *, num_pages, page_size=4, max_num_seqs=4, budget=16, prefix=False, max_context=256):
    manager = BlockManager(num_pages, page_size, enable_prefix_caching=prefix)
    sched = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_context=max_context,
                      watermark=0.0)
    reqs = [Request(request_id=i, prompt_ids=list(p), params=SamplingParams(max_tokens=m, temperature=0), seed=0)
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_unfinished:
        rows = sched.schedule()
        assert rows, "nothing scheduled while requests are unfinished"
        assert sum(r.count for r in rows) <= budget
        assert len(sched.running) <= max_num_seqs
        assert len({id(r.request) for r in rows}) == len(rows)
        for r in rows:
            req = r.request
            assert req.status == RUNNING
            assert r.start == req.num_computed and r.count >= 1
            assert r.start + r.count <= req.num_tokens
            assert req.seq.num_positions >= r.start + r.count  # reserved before the step
        sched.update(rows)
        sched.register(rows)
        for r in rows:
            if r.samples:
                req = r.request
                req.token_ids.append(fake_next(req.token_ids))
                if req.num_output >= req.params.max_tokens:
                    sched.finish(req, "length")
        # Pages: held ones plus free ones make the pool.
        held = {p for req in sched.running for p in req.seq.block_table}
        assert len(held) + manager.num_free_pages == manager.num_pages
        steps += 1
        assert steps < 10_000
    assert manager.num_free_pages == manager.num_pages
    assert all(r.status == FINISHED for r in reqs)
    return [r.output_ids for r in reqs], sched


def expected(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_next(tokens))
    return tokens[len(prompt):]


workloads = st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
                               st.integers(1, 30)), min_size=1, max_size=10)


@settings(max_examples=300, deadline=None)
@given(workloads, st.integers(1, 6), st.integers(1, 24), st.booleans(), st.integers(0, 40))
def test_outputs_do_not_depend_on_batching_pool_or_prefix_cache(work, max_num_seqs, budget, prefix, spare_pages):
    prompts = [p for p, _ in work]
    max_tokens = [m for _, m in work]
    page_size = 4
    # At least one request of the largest size must fit; spare pages beyond that vary the pressure.
    largest = max(-(-(len(p) + m) // page_size) for p, m in work)
    outs, sched = run(prompts, max_tokens, num_pages=largest + spare_pages, page_size=page_size,
                      max_num_seqs=max_num_seqs, budget=budget, prefix=prefix)
    assert outs == [expected(p, m) for p, m in work]


def test_small_pool_preempts_and_still_finishes():
    prompts = [[i % VOCAB] * 20 for i in range(6)]
    outs, sched = run(prompts, [30] * 6, num_pages=14, page_size=4, max_num_seqs=6, budget=64)
    assert sched.num_preemptions > 0
    assert outs == [expected(p, 30) for p in prompts]


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    manager = BlockManager(64, 4)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8, max_context=256, watermark=0.0)
    a = Request(request_id=0, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=10), seed=0)
    sched.add(a)
    rows = sched.schedule()
    sched.update(rows)
    sched.register(rows)
    a.token_ids.append(5)
    b = Request(request_id=1, prompt_ids=list(range(20)), params=SamplingParams(max_tokens=2), seed=0)
    sched.add(b)
    rows = sched.schedule()
    assert [(r.request.request_id, r.start, r.count) for r in rows] == [(0, 3, 1), (1, 0, 7)]
    assert rows[0].samples and not rows[1].samples
    sched.update(rows)
    sched.register(rows)
    a.token_ids.append(6)
    rows = sched.schedule()
    assert [(r.request.request_id, r.start, r.count) for r in rows] == [(0, 4, 1), (1, 7, 7)]


def test_prefix_hit_skips_cached_pages():
    manager = BlockManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_context=256, watermark=0.0)
    shared = list(range(10))
    a = Request(request_id=0, prompt_ids=shared + [40], params=SamplingParams(max_tokens=1), seed=0)
    sched.add(a)
    rows = sched.schedule()
    sched.update(rows)
    sched.register(rows)
    a.token_ids.append(1)
    sched.finish(a, "length")
    b = Request(request_id=1, prompt_ids=shared + [41, 42], params=SamplingParams(max_tokens=1), seed=0)
    sched.add(b)
    rows = sched.schedule()
    assert [(r.start, r.count) for r in rows] == [(8, 4)]  # two full pages (8 tokens) came from the cache
    assert b.num_cached_tokens == 8


def test_request_that_can_never_fit_is_rejected_up_front():
    manager = BlockManager(8, 4)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_context=100)
    with pytest.raises(ValueError, match="max_context"):
        sched.add(Request(request_id=0, prompt_ids=[1] * 90, params=SamplingParams(max_tokens=20), seed=0))
    with pytest.raises(ValueError, match="pages"):
        sched.add(Request(request_id=1, prompt_ids=[1] * 30, params=SamplingParams(max_tokens=10), seed=0))
    assert not sched.has_unfinished


def test_decode_buckets_cover_max_num_seqs():
    from tileinfer.runner.gpu import decode_buckets
    assert decode_buckets(256)[:8] == (1, 2, 4, 8, 16, 24, 32, 40)
    assert decode_buckets(256)[-1] == 256 and decode_buckets(100)[-1] == 100
    assert decode_buckets(1) == (1,) and decode_buckets(6) == (1, 2, 4, 6)
    b = decode_buckets(256)
    assert all(x < y for x, y in zip(b, b[1:])) and len(b) == 4 + 7 + 12


def test_prefill_buckets_pad_a_prompt_by_fewer_rows_than_a_gemm_row_tile():
    from tileinfer.runner.gpu import PREFILL_BUCKETS, prefill_bucket
    assert [prefill_bucket(n, 4096) for n in (2, 16, 17, 33, 64, 65, 129, 300, 512, 513, 700, 896)] == \
        [16, 16, 32, 64, 64, 128, 192, 320, 512, 640, 768, 896]
    assert prefill_bucket(897, 4096) is None                  # past the largest bucket: an eager step of its own
    assert prefill_bucket(200, 256) == 256 and prefill_bucket(300, 256) is None  # no bucket past the largest step
    for n in range(65, PREFILL_BUCKETS[-1] + 1):
        bucket = prefill_bucket(n, 4096)
        assert 0 <= bucket - n < (64 if n <= 512 else 128)
        assert n <= 512 or bucket // 128 == -(-n // 128)     # past 512: the products' 128-row tiles unpadded
