"""Apertus on the GPU: the forward pass (xIELU in the up projection's epilogue, one MLP input matrix, the
llama3-scaled RoPE table, Apertus' norm names) against the float32 numpy reference and against
transformers' ApertusForCausalLM on the same directory, at the apertus-tiny and apertus-8b shapes; greedy
generation across page boundaries; the INT8 cache with and without key smoothing; decode graphs; the
engine's batches (1-2 rows on the GEMV, 3-64 on the swap-AB GEMM with the norm statistics, more on the
TMA GEMM); a chat; speculative decoding. Tolerances as tests/gpu/test_model.py states them."""
from __future__ import annotations

import numpy as np
import pytest

import tileinfer
from tileinfer import LLM, ChatSession, SamplingParams
from tileinfer.kv import Sequence
from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.reference import ReferenceModel
from tileinfer.model.synthetic import cached_checkpoint

from test_model import check_agreement, compare_logits, compare_prompts  # noqa: E402

pytestmark = pytest.mark.gpu

TEXT_IDS = (73, 329)  # apertus-tiny's byte tokens (model/apertus_tokenizer.py): no control token among them


@pytest.fixture(scope="module")
def model(apertus_tiny_checkpoint):
    m = tileinfer.load_model(apertus_tiny_checkpoint, progress=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def reference(apertus_tiny_checkpoint):
    return ReferenceModel.from_checkpoint(Checkpoint.open(apertus_tiny_checkpoint))


def prompt_ids(n: int, seed: int, vocab: tuple[int, int] = TEXT_IDS) -> list[int]:
    return np.random.default_rng(seed).integers(*vocab, n).tolist()


def test_tiny_logits_match_reference(model, reference):
    compare_prompts(model.logits, reference.forward, "apertus-tiny", reference, prompt=prompt_ids)


def test_tiny_logits_chunked_across_pages(model, reference):
    ids = prompt_ids(300, seed=2)
    whole = reference.forward(ids)
    for chunk in (48, 256):
        result = compare_logits(model.logits(ids, chunk=chunk), whole, f"apertus-tiny, 300 tokens in chunks of {chunk}")
        baseline = float(np.mean(reference.forward_bf16_activations(ids).argmax(1) == whole.argmax(1)))
        check_agreement([result], len(ids), f"apertus-tiny, chunks of {chunk}", baseline)


def test_five_token_step_takes_the_epilogue_norm_path(model, reference):
    # A 5-token step runs its products on the swap-AB GEMM with the norms' statistics from the residual
    # products (the xIELU product is the statistics' consumer there).
    cache = model.ensure_cache(700)
    ids = prompt_ids(60, seed=31)
    seq = Sequence()
    try:
        model.extend(seq, ids[:55])
        five = model.extend(seq, ids[55:])
    finally:
        cache.manager.release(seq)
    compare_logits(five, reference.forward(ids)[55:], "apertus-tiny 5-token step vs reference")


def test_generation_across_page_boundaries_equals_reference_greedy(model, reference):
    prompt = prompt_ids(30, seed=6)
    n = 200  # positions 30..229 cross the page boundaries at 64, 128 and 192
    got = tileinfer.generate(model, prompt, max_new_tokens=n, stop_at_eos=False).token_ids
    ref = reference.forward(prompt + got[:-1])[len(prompt) - 1:]
    top = np.sort(ref, axis=1)[:, -2:]
    gap = (top[:, 1] - top[:, 0]) / ref.std(axis=1)
    mismatch = [i for i in range(n) if got[i] != int(ref[i].argmax())]
    print(f"apertus-tiny greedy: teacher-forced mismatches {mismatch}, gaps {[round(float(gap[i]), 4) for i in mismatch]}")
    assert all(gap[i] < 0.02 for i in mismatch) and len(mismatch) <= 2
    ref_greedy = reference.greedy(prompt, n)
    first = next((i for i in range(n) if got[i] != ref_greedy[i]), n)
    print(f"apertus-tiny greedy: equal to the reference's own greedy for {first} of {n} tokens")
    assert first == n or gap[first] < 0.02, f"diverged from the reference at token {first}"


def test_graph_replay_equals_eager(model):
    prompt = prompt_ids(20, seed=5)
    model.use_graphs = False
    try:
        eager = tileinfer.generate(model, prompt, max_new_tokens=40, stop_at_eos=False).token_ids
    finally:
        model.use_graphs = True
    assert tileinfer.generate(model, prompt, max_new_tokens=40, stop_at_eos=False).token_ids == eager


def test_int8_cache_with_and_without_smoothing(model, reference):
    # Against the reference's INT8 cache (quantized as tileinfer/kv/int8.py says), and the mean KL of the
    # next-token distributions against the BF16 cache, smoothed and not.
    ids = prompt_ids(300, seed=22)
    base = reference.forward(ids)
    kls = {}
    for smoothing in (True, False):
        got = model.logits(ids, kv_quantize="int8", smoothing=smoothing, chunk=48)
        expected = reference.forward(ids, reference.new_cache(int8=True, smoothing=smoothing))
        err = np.abs(got - expected) / expected.std(axis=1, keepdims=True)
        assert err.mean() <= 0.05, f"INT8 (smoothing={smoothing}) against the INT8 reference: mean {err.mean():.4f} std"
        p, q = log_softmax(base), log_softmax(got)
        kls[smoothing] = float((np.exp(p) * (p - q)).sum(-1).mean())
    print(f"apertus-tiny INT8 cache: mean KL(BF16 reference || engine INT8) smoothed {kls[True]:.6f}, "
          f"unsmoothed {kls[False]:.6f} over {len(ids)} positions")
    assert kls[True] <= 0.05


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_engine_batches_follow_the_reference(apertus_tiny_checkpoint, reference):
    # 40 requests decoding together (the swap-AB and TMA products, decode graphs of several buckets): each
    # generated token is the reference's teacher-forced argmax or a near tie.
    prompts = [prompt_ids(20 + 3 * i, seed=100 + i) for i in range(40)]
    with LLM(apertus_tiny_checkpoint, max_num_seqs=64, max_context=512, progress=False) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ref = reference.forward(p + o.token_ids[:-1])[len(p) - 1:]
        top = np.sort(ref, axis=1)[:, -2:]
        gap = (top[:, 1] - top[:, 0]) / ref.std(axis=1)
        bad = [j for j, t in enumerate(o.token_ids) if t != int(ref[j].argmax()) and gap[j] >= 0.02]
        assert not bad, f"request {i}: tokens {bad} are neither the reference's argmax nor a near tie"


def test_chat_session_reuses_its_prefix(apertus_tiny_checkpoint):
    with LLM(apertus_tiny_checkpoint, max_num_seqs=2, max_context=1024, progress=False) as llm:
        chat = ChatSession(llm, max_context=1024, system="You are brief.")
        chat.send("Hello", max_tokens=12)
        first = chat.last_turn
        chat.send("And then?", max_tokens=12)
        second = chat.last_turn
        assert first.reused_tokens == 0 and first.computed_tokens == first.prompt_tokens
        assert second.reused_tokens > first.prompt_tokens
        assert second.computed_tokens == second.prompt_tokens - second.reused_tokens
        assert not llm.has_unfinished_requests()


def test_greedy_speculation_equals_plain_greedy(apertus_tiny_checkpoint):
    prompt = prompt_ids(70, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(apertus_tiny_checkpoint, batch_invariant=True, max_context=512, progress=False) as llm:
        want = llm.generate([prompt], params)[0].token_ids
    with LLM(apertus_tiny_checkpoint, batch_invariant=True, max_context=512, draft_model=apertus_tiny_checkpoint,
             num_draft_tokens=4, progress=False) as llm:
        got = llm.generate([prompt], params)[0]
    assert got.token_ids == want
    assert got.speculation.acceptance_rate > 0.9


# ------------------------------------------------------------------------------------------- transformers


def transformers_logits(path, dtype: str = "float32"):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.ApertusForCausalLM.from_pretrained(path, torch_dtype=getattr(torch, dtype)).cuda().eval()

    def logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()

    return hf, logits


def test_tiny_logits_match_transformers(model, reference, apertus_tiny_checkpoint):
    hf, hf_logits = transformers_logits(apertus_tiny_checkpoint)
    ids = prompt_ids(64, seed=4)
    rel = np.abs(reference.forward(ids) - hf_logits(ids)).max() / hf_logits(ids).std()
    print(f"apertus-tiny: numpy reference vs transformers float32: max |err|/std = {rel:.2e}")
    assert rel < 1e-3
    compare_prompts(model.logits, hf_logits, "apertus-tiny vs transformers (float32)", reference, prompt=prompt_ids)
    del hf


def test_8b_logits_match_reference_and_transformers():
    # One 48-token prompt: the float32 reference holds 32 GB of weights on the host, transformers 32 GB on
    # the GPU, and our engine 16 GB beside it.
    path = cached_checkpoint("apertus-8b")
    ids = prompt_ids(48, seed=9, vocab=(1000, 131072))
    with tileinfer.load_model(path, progress=False) as m:
        ours = m.logits(ids)
    hf, hf_logits = transformers_logits(path)
    theirs = hf_logits(ids)
    del hf
    import torch
    torch.cuda.empty_cache()
    reference = ReferenceModel.from_checkpoint(Checkpoint.open(path))
    expected = reference.forward(ids)
    rel = np.abs(expected - theirs).max() / theirs.std()
    print(f"apertus-8b: numpy reference vs transformers float32: max |err|/std = {rel:.2e}")
    assert rel < 1e-3
    result = compare_logits(ours, expected, "apertus-8b vs reference")
    baseline = float(np.mean(reference.forward_bf16_activations(ids).argmax(1) == expected.argmax(1)))
    check_agreement([result], len(ids), "apertus-8b vs reference", baseline)
    compare_logits(ours, theirs, "apertus-8b vs transformers (float32)")
