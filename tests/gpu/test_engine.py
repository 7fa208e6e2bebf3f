"""The batching engine (tileinfer.LLM) on the GPU: batching, prefix caching, graphs and
preemption must not change a request's tokens; sampling, stops, logprobs, streaming, memory.

Prompts are random token ids at awkward lengths (around page boundaries, longer than a prefill
chunk). Greedy requests use ignore_eos so every request runs its full max_tokens.

Exact token equality across different batches, chunkings and recomputation needs the
batch-invariant mode (runner/gpu.py): by default the kernels differ with the batch size, and
random synthetic models have many near-ties, so a last-bit difference can flip a greedy token.
Graphs on == off holds in the default mode (the same launches either way).
"""
from __future__ import annotations

import numpy as np
import pytest

from tileinfer import LLM, SamplingParams
from tileinfer.cuda import allocated_bytes
from tileinfer.model.synthetic import cached_checkpoint

pytestmark = pytest.mark.gpu

LENGTHS = [1, 5, 63, 64, 65, 130, 300, 777]


def prompts_of(lengths, seed, vocab=151643):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def engine(path, **kw):
    args = dict(max_num_seqs=16, max_context=1024, num_pages=160, max_num_batched_tokens=512, progress=False)
    args.update(kw)
    return LLM(path, **args)


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoint):
    llm = engine(tiny_checkpoint, batch_invariant=True)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def small_ckpt():
    return cached_checkpoint("qwen3-0.6b")


def tokens(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("which, kv", [("tiny", None), ("qwen3-0.6b", None), ("tiny", "int8")])
def test_batch_gives_each_prompt_its_tokens_alone(which, kv, tiny_checkpoint, small_ckpt):
    path = tiny_checkpoint if which == "tiny" else small_ckpt
    prompts = prompts_of(LENGTHS, seed=1)
    params = [greedy(m) for m in (24, 9, 30, 17, 33, 12, 28, 20)]
    with engine(path, batch_invariant=True, kv_quantize=kv) as llm:
        assert llm.runner.cache.int8 == (kv == "int8")
        together = llm.generate(prompts, params)
        alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
        assert llm.stats.graph_steps > 0
    for i, (a, b) in enumerate(zip(together, alone)):
        assert len(a.token_ids) == params[i].max_tokens and a.finish_reason == "length"
        assert a.token_ids == b.token_ids, f"prompt {i} ({LENGTHS[i]} tokens) differs in a batch"


def test_prefix_caching_on_equals_off(small_ckpt):
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 151643, 300).tolist()
    prompts = [shared + rng.integers(0, 151643, n).tolist() for n in (1, 40, 64, 100)]
    prompts.append(list(shared))  # a full hit except the last token
    params = greedy(16)
    with engine(small_ckpt, enable_prefix_caching=True, batch_invariant=True) as on, \
            engine(small_ckpt, enable_prefix_caching=False, batch_invariant=True) as off:
        first = on.generate(prompts[:1], params)  # fills the cache with the shared prefix
        hits = on.generate(prompts, params)
        plain = off.generate(prompts, params)
    assert first[0].token_ids == plain[0].token_ids
    assert tokens(hits) == tokens(plain)
    assert all(o.num_cached_tokens >= 256 for o in hits)  # four full pages of the 300 shared tokens
    assert all(o.num_cached_tokens == 0 for o in plain)


def test_graphs_on_equals_off(small_ckpt):
    prompts = prompts_of(LENGTHS, seed=3)
    with engine(small_ckpt, use_graphs=False) as eager, engine(small_ckpt) as graphs:
        a = eager.generate(prompts, greedy(20))
        b = graphs.generate(prompts, greedy(20))
        assert eager.stats.graph_steps == 0 and graphs.stats.graph_steps > 0
    assert tokens(a) == tokens(b)


@pytest.mark.parametrize("which, kv", [("tiny", None), ("qwen3-0.6b", None), ("tiny", "int8")])
def test_pool_too_small_for_the_batch_preempts_and_completes(which, kv, tiny_checkpoint, small_ckpt):
    path = tiny_checkpoint if which == "tiny" else small_ckpt
    prompts = prompts_of([100, 150, 200, 250, 120, 90], seed=4)
    params = greedy(100)
    with engine(path, batch_invariant=True, kv_quantize=kv) as roomy:
        want = roomy.generate(prompts, params)
    # The requests end at 3 to 6 pages of 64 each (26 together); 10 pages hold two or three at once,
    # and those outgrow them: the newest is preempted and recomputed later.
    with engine(path, num_pages=10, max_context=512, batch_invariant=True, kv_quantize=kv) as tight:
        got = tight.generate(prompts, params)
        assert tight.stats.preemptions > 0
        assert tight.runner.cache.manager.num_free_pages == 10
    assert tokens(got) == tokens(want)


def test_seeded_sample_is_the_same_alone_and_in_a_batch(tiny_llm):
    prompts = prompts_of(LENGTHS, seed=5)
    sampled = SamplingParams(max_tokens=24, temperature=3.0, top_k=50, top_p=0.95, min_p=0.001, seed=1234,
                             ignore_eos=True)
    others = [SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True) for n, s in
              zip((5, 30, 11, 19, 7, 26, 13), range(7))]
    alone = tiny_llm.generate([prompts[3]], sampled)[0]
    batch = tiny_llm.generate(prompts[:3] + [prompts[3]] + prompts[4:], others[:3] + [sampled] + others[3:])[3]
    assert alone.token_ids == batch.token_ids
    assert len(set(alone.token_ids)) > 1, "the draw is degenerate: the test cannot see the seed"
    again = tiny_llm.generate([prompts[3]], SamplingParams(max_tokens=24, temperature=3.0, top_k=50, top_p=0.95,
                                                           min_p=0.001, seed=999, ignore_eos=True))[0]
    assert again.token_ids != alone.token_ids  # another seed, another draw


def test_penalties_change_greedy_output_and_are_batch_independent(tiny_llm):
    prompt = prompts_of([40], seed=6)[0]
    plain = tiny_llm.generate([prompt], greedy(40))[0]
    pen = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                         frequency_penalty=1.0, presence_penalty=0.5)
    alone = tiny_llm.generate([prompt], pen)[0]
    batch = tiny_llm.generate(prompts_of([10, 70], seed=7) + [prompt], [greedy(30), greedy(5), pen])[2]
    assert alone.token_ids == batch.token_ids
    # With strong penalties no output token may repeat while fresh ones win: far fewer repeats.
    assert len(set(alone.token_ids)) >= len(set(plain.token_ids))


def test_structured_output_on_the_gpu_holds_and_leaves_free_requests_alone(tiny_llm):
    import json

    import jsonschema

    from tileinfer.engine.structured import StructuredOutputs
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                        "maxItems": 3}},
              "required": ["id", "tags"], "additionalProperties": False}
    json_params = [SamplingParams(max_tokens=60, temperature=t, seed=s, structured_outputs=StructuredOutputs(json=schema))
                   for t, s in ((0, 0), (1.0, 1), (0.7, 2))]
    free = prompts_of([33, 70], seed=12)
    alone = [o.token_ids for o in tiny_llm.generate(free, greedy(20))]
    outs = tiny_llm.generate(prompts_of([9, 9, 40], seed=13) + free, json_params + [greedy(20), greedy(20)])
    for o in outs[:3]:
        jsonschema.validate(json.loads(o.text), schema)
        assert o.finish_reason == "stop"
    assert [o.token_ids for o in outs[3:]] == alone  # the free requests' tokens as without the others
    choice = tiny_llm.generate(prompts_of([12], seed=14), SamplingParams(
        max_tokens=10, temperature=0, structured_outputs=StructuredOutputs(choice=["alpha", "beta"])))[0]
    assert choice.text in ("alpha", "beta")


def test_structured_output_pipelined_gives_the_unpipelined_tokens(tiny_checkpoint, tiny_llm):
    # The engine computes a step's masks after launching it (pipelined) or before reading it back with
    # nothing in flight (async_scheduling=False): the same tokens (batch-invariant engines), all valid.
    import json

    import jsonschema

    from tileinfer.engine.structured import StructuredOutputs
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "n", "ok"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=80, temperature=0.8 if i % 2 else 0, seed=i,
                             structured_outputs=StructuredOutputs(json=schema)) for i in range(12)] + [greedy(30)] * 4
    prompts = prompts_of([5, 40, 63, 64, 65, 9, 17, 3, 100, 31, 8, 12, 33, 70, 1, 20], seed=16)
    pipelined = tiny_llm.generate(prompts, params)
    with engine(tiny_checkpoint, batch_invariant=True, async_scheduling=False) as llm:
        unpipelined = llm.generate(prompts, params)
    assert tokens(pipelined) == tokens(unpipelined)
    for o in pipelined[:12]:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), schema)


def test_stops_and_finish_reasons(tiny_llm):
    prompt = prompts_of([20], seed=8)[0]
    base = tiny_llm.generate([prompt], greedy(30))[0]
    stop_token = base.token_ids[10]
    first = base.token_ids.index(stop_token)
    by_token = tiny_llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                          stop_token_ids=[stop_token]))[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_token
    assert by_token.token_ids == base.token_ids[:first + 1]
    text = base.text
    assert len(text) > 10
    stop = text[len(text) // 2: len(text) // 2 + 3]
    by_text = tiny_llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                         stop=[stop]))[0]
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop
    assert by_text.text == text[:text.index(stop)]
    assert base.finish_reason == "length"


def test_logprobs(tiny_llm):
    prompt = prompts_of([33], seed=9)[0]
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5))[0]
    assert len(out.logprobs) == 6
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) == 5  # greedy: the sampled token is the top one
        values = sorted(entry.values(), reverse=True)
        assert entry[tok] == values[0] and all(v <= 0 for v in values)
        assert sum(np.exp(values)) <= 1 + 1e-6


def test_stream_matches_generate(tiny_llm):
    prompts = prompts_of([3, 70, 140], seed=10)
    params = greedy(15)
    want = tiny_llm.generate(prompts, params)
    got_ids = [[] for _ in prompts]
    got_text = ["" for _ in prompts]
    finished = [None] * len(prompts)
    for ev in tiny_llm.generate_stream(prompts, params):
        got_ids[ev.index] += ev.token_ids
        got_text[ev.index] += ev.text
        if ev.finished:
            finished[ev.index] = ev.finish_reason
    assert got_ids == tokens(want)
    assert got_text == [o.text for o in want]
    assert finished == ["length"] * 3


def test_stream_closed_early_frees_pages(tiny_llm):
    manager = tiny_llm.runner.cache.manager
    free = manager.num_free_pages
    gen = tiny_llm.generate_stream(prompts_of([50, 90], seed=11), greedy(40))
    next(gen)
    gen.close()
    assert manager.num_free_pages == free and not tiny_llm.engine.scheduler.has_unfinished


def test_bad_requests_raise_clear_errors(tiny_llm):
    with pytest.raises(ValueError, match="max_context"):
        tiny_llm.generate([[1] * 1000], greedy(100))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([[1, 999_999]], greedy(2))
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([""], greedy(2))
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        tiny_llm.generate([[1], [2], [3]], [greedy(1), greedy(1)])
    assert not tiny_llm.engine.scheduler.has_unfinished


def test_text_prompts_and_close_frees_everything(tiny_checkpoint):
    before = allocated_bytes()
    llm = engine(tiny_checkpoint)
    out = llm.generate(["Hello", "The capital of France is"], greedy(5))
    assert all(len(o.token_ids) == 5 and isinstance(o.text, str) for o in out)
    assert out[0].prompt_token_ids == [9707]
    llm.close()
    assert allocated_bytes() == before
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["x"])


def test_int8_pool_and_memory_report(tiny_checkpoint):
    # Sized from free memory: an INT8 pool holds (2 x 128 bf16) / (128 + 4) = 1.94x the positions per byte.
    from tileinfer.kv import sizing
    with LLM(tiny_checkpoint, max_num_seqs=4, max_context=512, kv_quantize="int8", progress=False) as llm:
        report = llm.memory_report
        assert report.kv_dtype == "int8" and llm.runner.cache.int8 and llm.runner.cache.smoothing is not None
        per_page = sizing.bytes_per_page(llm.model_config, llm.config.page_size, "int8")
        assert report.kv_pool == llm.runner.cache.layout.num_pages * per_page == llm.runner.cache.layout.nbytes
        outs = llm.generate(prompts_of([5, 70], seed=9), greedy(12))
        assert [len(o.token_ids) for o in outs] == [12, 12]
    with pytest.raises(ValueError, match="kv_quantize"):
        LLM(tiny_checkpoint, kv_quantize="fp8", progress=False)


def test_startup_times(tiny_checkpoint):
    # The parts are timed inside the total; a second engine in the process compiles no kernel.
    for _ in range(2):
        with LLM(tiny_checkpoint, max_num_seqs=8, max_context=512, progress=False) as llm:
            s = llm.startup
            print(s.format())
            assert s.graphs == llm.runner.graphs.count("decode") > 0
            assert min(s.weights, s.kernels, s.warm_up, s.capture) >= 0
            assert s.weights + s.kernels + s.warm_up + s.capture <= s.total
    assert s.kernels_compiled == 0
