"""Speculative decoding on the GPU (tileinfer/engine/speculative.py; the algorithm's CPU tests are
tests/test_speculative.py). The target runs batch-invariant, so a position's logits are bitwise the
same in a verify chunk and in a decode step, and greedy speculation must reproduce plain greedy
decoding token for token."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

import tileinfer
from tileinfer.engine.params import SamplingParams
from tileinfer.engine.scheduler import FINISHED
from tileinfer.engine.speculative import OracleDraft, distribution
from tileinfer.generate import engine_over
from tileinfer.kv import Sequence
from tileinfer.model.config import preset
from tileinfer.model.synthetic import write_checkpoint
from tileinfer.runner.gpu import verify_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stats_helpers import assert_split_fits, chi2_critical  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tiny_checkpoint, tmp_path_factory):
    other = tmp_path_factory.mktemp("tiny-draft")
    write_checkpoint(preset("tiny"), other, seed=1, progress=False)
    target = tileinfer.load_model(tiny_checkpoint, progress=False, batch_invariant=True)
    draft = tileinfer.load_model(other, progress=False)
    same = tileinfer.load_model(tiny_checkpoint, progress=False)
    yield target, draft, same
    for m in (target, draft, same):
        m.close()


@pytest.mark.parametrize("which", ["other", "same"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_equals_plain_greedy(models, which, k):
    target, other, same = models
    draft_model = other if which == "other" else same
    prompt = np.random.default_rng(k).integers(0, 151643, 70).tolist()
    want = tileinfer.generate(target, prompt, max_new_tokens=40, stop_at_eos=False).token_ids
    got = tileinfer.generate(target, prompt, max_new_tokens=40, stop_at_eos=False, draft_model=draft_model,
                             num_draft_tokens=k)
    assert got.token_ids == want
    s = got.speculation
    print(f"draft {which}, k={k}: {s.accepted}/{s.drafted} accepted, {s.tokens_per_target_step:.2f} tokens/step")
    if which == "same":
        assert s.acceptance_rate > 0.9  # the same weights (not batch-invariant: near ties may differ)


def test_caches_hold_exactly_the_accepted_positions(models):
    # After every round the target's sequence holds the committed tokens but the last (its block table no
    # more pages than that), the draft's a prefix of them; every page of both comes back at the end.
    target, other, _ = models
    prompt = np.random.default_rng(5).integers(0, 151643, 130).tolist()
    engine = engine_over(target, 400, draft=other, num_draft_tokens=4)
    req = engine.make_request(prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    engine.add(req)
    rounds = 0
    while req.status != FINISHED:
        engine.step()
        if req.status == FINISHED or req.spec.target_steps == rounds:
            continue
        rounds = req.spec.target_steps
        assert req.seq.num_positions == req.num_tokens - 1
        assert len(req.seq.block_table) == -(-(req.num_tokens - 1) // target.cache.page_size)
        seq, fed = engine.drafter.held[req.request_id]
        assert seq.num_positions == len(fed) and fed == req.token_ids[:len(fed)]
        assert len(seq.block_table) == -(-len(fed) // other.cache.page_size)
    engine.drain()
    engine.step()  # the finished request's draft sequence is released at the next step
    assert len(req.output_ids) == 60 and rounds > 0
    assert target.cache.manager.num_free_pages == target.cache.layout.num_pages
    assert other.cache.manager.num_free_pages == other.cache.layout.num_pages


def test_oracle_draft_accepts_everything(models):
    target, _, _ = models
    prompt = np.random.default_rng(6).integers(0, 151643, 33).tolist()
    want = tileinfer.generate(target, prompt, max_new_tokens=25, stop_at_eos=False).token_ids
    got = tileinfer.generate(target, prompt, max_new_tokens=25, stop_at_eos=False,
                             draft_model=OracleDraft(len(prompt), want), num_draft_tokens=4)
    assert got.token_ids == want and got.speculation.acceptance_rate == 1.0


def test_chat_with_a_draft_equals_chat_without(models):
    target, other, _ = models
    plain = tileinfer.ChatSession(target, max_context=1024, system="S")
    replies = [plain.send(m, max_tokens=24) for m in ("Hello", "More, please", "And again")]
    plain_turns = plain.last_turn
    plain.close()
    spec = tileinfer.ChatSession(target, max_context=1024, system="S", draft_model=other, num_draft_tokens=3)
    got = [spec.send(m, max_tokens=24) for m in ("Hello", "More, please", "And again")]
    assert got == replies
    assert spec.last_turn.reused_tokens == plain_turns.reused_tokens and spec.last_turn.speculation.drafted > 0
    spec.close()


def test_graphed_verify_equals_the_eager_verify(models):
    # GPURunner.verify(graph_width=5): the step padded to the batch's bucket (3 rows -> 4) x 5 tokens, replayed
    # from a graph after its first (eager) run. The target is batch-invariant, so the padding cannot change
    # a row's logits: bitwise the eager, unpadded step's, round after round (new tokens each time).
    target, _, _ = models
    cache = target.ensure_cache(1024)
    rng = np.random.default_rng(11)
    seqs = []
    try:
        for n in (40, 9, 70):
            seq = Sequence()
            target.extend(seq, rng.integers(0, 151643, n).tolist(), logits="none")
            seqs.append(seq)
        for _ in range(3):
            batch = []
            for seq, q in zip(seqs, (5, 2, 4)):
                start = seq.num_positions
                cache.manager.reserve(seq, q)
                batch.append((seq, rng.integers(0, 151643, q).tolist(), start))
            eager = target.verify(batch, logits="all")
            np.testing.assert_array_equal(target.verify(batch, logits="all", graph_width=5), eager)
            np.testing.assert_array_equal(target.verify(batch, logits="argmax", graph_width=5), eager.argmax(axis=1))
        # The padded step's graph of bucket 4 (the generate tests before may have left argmax's bucket 1).
        assert target.graphs.buckets(verify_kind(5, "all")) == [4]
        assert 4 in target.graphs.buckets(verify_kind(5, "argmax"))
        # A row longer than the graph's width runs eagerly (no new graph).
        seq = seqs[0]
        start = seq.num_positions
        cache.manager.reserve(seq, 7)
        long_row = [(seq, rng.integers(0, 151643, 7).tolist(), start)]
        np.testing.assert_array_equal(target.verify(long_row, logits="all", graph_width=5),
                                      target.verify(long_row, logits="all"))
        assert target.graphs.buckets(verify_kind(5, "all")) == [4]
    finally:
        for seq in seqs:
            cache.manager.release(seq)


# ----------------------------------------------------------------------------- sampled outputs
SMALL_VOCAB = 48  # a vocabulary small enough to count every pair of tokens


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    """Target (batch-invariant) and draft checkpoints of 48 tokens, untied embeddings: at temperature 2
    the target's first token has p_max ~0.42 (entropy ~2.2 nats) and the draft's distribution is 0.72
    away from it in total variation (the float32 reference on these seeds), so proposals are often
    rejected and every path of the acceptance rule runs."""
    cfg = dataclasses.replace(preset("tiny"), vocab_size=SMALL_VOCAB, tie_word_embeddings=False)
    paths = []
    for name, seed in (("target", 3), ("draft", 4)):
        path = tmp_path_factory.mktemp(f"small-vocab-{name}")
        write_checkpoint(cfg, path, seed=seed, progress=False)
        paths.append(path)
    target = tileinfer.load_model(paths[0], progress=False, batch_invariant=True)
    draft = tileinfer.load_model(paths[1], progress=False)
    yield target, draft
    target.close()
    draft.close()


def next_distributions(model, params: SamplingParams, prefix: list[int], depth: int) -> dict:
    """{tokens: probability} of every `depth`-token continuation of `prefix` under `model` and `params`
    (the GPU's logits, float64 softmax as the acceptance rule computes it)."""
    seq, manager = Sequence(), model.cache.manager
    try:
        model.extend(seq, prefix[:-1], logits="none")
        out = {}

        def walk(tokens: list[int], prob: float):
            fed = tokens[-1:] or prefix[-1:]  # the cache holds prefix[:-1] + tokens[:-1]
            p = distribution(model.extend(seq, fed, logits="last")[-1], params.temperature, params.top_k,
                             params.top_p)
            for t in np.nonzero(p)[0]:
                if len(tokens) + 1 == depth:
                    out[tuple(tokens) + (int(t),)] = prob * float(p[t])
                else:
                    walk(tokens + [int(t)], prob * float(p[t]))
            manager.truncate(seq, len(prefix) - 1 + len(tokens))  # drop `fed` again

        walk([], 1.0)
        return out
    finally:
        manager.release(seq)


@pytest.mark.parametrize("params", [SamplingParams(temperature=2.0), SamplingParams(temperature=2.0, top_k=12,
                                                                                     top_p=0.9)],
                         ids=["T2", "T2-topk12-topp0.9"])
def test_sampled_speculation_has_the_targets_distribution(small_vocab_models, params):
    """The first three tokens of N = 3,000 seeded runs (the first from the prefill, the next two from a
    round with one proposal of the qwen3-shaped draft; both caches rolled back) against the target's
    exact distribution: Pearson's chi-square on the joint of tokens 1-2 and on token 3's marginal, each at
    alpha = 1e-4, cells expected below 5 pooled. Power: a bug that accepts every proposal makes token 2
    follow the draft's greedy choice, far from the target's distribution at temperature 2 (checked below
    as a noncentrality of at least 4x the critical value)."""
    target, draft = small_vocab_models
    prompt, n_runs = [5, 17, 30, 2], 3000
    counts12, counts3 = {}, {}
    for seed in range(n_runs):
        out = tileinfer.generate(target, prompt, max_new_tokens=3, temperature=params.temperature,
                                 top_k=params.top_k, top_p=params.top_p, seed=seed, stop_at_eos=False,
                                 draft_model=draft, num_draft_tokens=2)
        assert out.speculation.drafted == 1
        tokens = out.token_ids
        counts12[tuple(tokens[:2])] = counts12.get(tuple(tokens[:2]), 0) + 1
        counts3[(tokens[2],)] = counts3.get((tokens[2],), 0) + 1
    assert_split_fits(next_distributions(target, params, prompt, 3), 2, counts12, counts3, n_runs,
                      ("tokens 1-2", "token 3"))
    # Power against "accept every proposal": token 2 would be the draft's greedy token after token 1.
    joint = next_distributions(target, params, prompt, 2)
    bug: dict[tuple, float] = {}
    for t1, p1 in next_distributions(target, params, prompt, 1).items():
        seq = Sequence()
        try:
            row = draft.extend(seq, prompt + list(t1), logits="last")[-1]
        finally:
            draft.cache.manager.release(seq)
        cell = (t1[0], int(np.argmax(row)))
        bug[cell] = bug.get(cell, 0.0) + p1
    big = [c for c in joint if joint[c] * n_runs >= 5]
    rest_p = 1.0 - sum(joint[c] for c in big)
    rest_q = 1.0 - sum(bug.get(c, 0.0) for c in big)
    lam = n_runs * sum((bug.get(c, 0.0) - joint[c]) ** 2 / joint[c] for c in big)
    if rest_p > 1e-12:
        lam += n_runs * (rest_q - rest_p) ** 2 / rest_p
    crit = chi2_critical(len(big) - (rest_p <= 1e-12))
    print(f"noncentrality against accepting every proposal: {lam:.0f} (critical {crit:.1f})")
    assert lam > 4 * crit


# ----------------------------------------------------------------------------- the batching engine
# LLM(draft_model=...): every running request's proposals checked in one verify step. Batch-invariant,
# so a position's logits do not depend on the step around it and greedy output must equal plain LLM's.

@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
    other = tmp_path_factory.mktemp("tiny-draft-llm")
    write_checkpoint(preset("tiny"), other, seed=1, progress=False)
    return other


def llm_prompts():
    rng = np.random.default_rng(9)
    return [rng.integers(0, 151643, int(n)).tolist() for n in (1, 17, 70, 130, 5)]


@pytest.mark.parametrize("which, graphs", [("other", True), ("same", True), ("other", False)])
def test_llm_greedy_speculation_equals_plain(tiny_checkpoint, draft_checkpoint, which, graphs):
    prompts = llm_prompts()
    params = [tileinfer.SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (30, 41, 25, 37, 50)]
    kw = dict(max_num_seqs=4, max_context=512, num_pages=64, page_size=16, batch_invariant=True, progress=False,
              use_graphs=graphs)
    with tileinfer.LLM(tiny_checkpoint, **kw) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    draft = draft_checkpoint if which == "other" else tiny_checkpoint
    with tileinfer.LLM(tiny_checkpoint, draft_model=draft, num_draft_tokens=4, **kw) as llm:
        outs = llm.generate(prompts, params)  # 5 requests through 4 rows: one waits, then joins
        assert [o.token_ids for o in outs] == want
        draft_pages = llm.engine.drafter.runner.cache.manager.num_free_pages
        assert llm.engine.scheduler.manager.num_free_pages == 64 and draft_pages == 64
        r = llm.memory_report
        if r is not None:  # the draft's memory is reported, and the report still adds up
            assert r.draft > 0 and abs(r.unaccounted) < 0.02 * r.total, r.format()
        assert (llm.runner.graphs.count() > llm.runner.graphs.count("decode")) == graphs  # verify graphs
    drafted = sum(o.speculation.drafted for o in outs)
    accepted = sum(o.speculation.accepted for o in outs)
    print(f"LLM, draft {which}, verify graphs {graphs}: {accepted}/{drafted} accepted")
    assert drafted > 0
    if which == "same":
        assert accepted > 0.9 * drafted  # the same weights (the draft is not batch-invariant: near ties may differ)


def test_llm_speculation_with_sampling_and_penalties(tiny_checkpoint, draft_checkpoint):
    # Sampled requests speculate (the target's distribution is kept by rejection sampling; its
    # statistics are tests/test_llm_speculation.py's), requests with penalties decode plainly; all finish.
    prompts = llm_prompts()
    params = [tileinfer.SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=i, ignore_eos=True,
                                       repetition_penalty=1.2 if i == 2 else 1.0) for i in range(len(prompts))]
    with tileinfer.LLM(tiny_checkpoint, draft_model=draft_checkpoint, num_draft_tokens=3, max_num_seqs=4,
                       max_context=512, num_pages=64, page_size=16, progress=False) as llm:
        outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 20 for o in outs)
    assert outs[2].speculation is None and all(o.speculation.target_steps > 0 for i, o in enumerate(outs) if i != 2)


def test_a_dflash_drafter_drafts_for_a_model_on_its_own_device(models, dflash_tiny_checkpoint):
    # A drafter loaded for the CPU paired with a GPU model fails with one clear line (naming device='cuda'),
    # before the target is asked to capture anything (tests/gpu/test_dflash_gpu.py runs the GPU pair).
    target, _, _ = models
    drafter = tileinfer.load_model(dflash_tiny_checkpoint, device="cpu")
    with pytest.raises(ValueError, match=r"device='cuda'"):
        tileinfer.generate(target, [1, 2, 3], max_new_tokens=4, draft_model=drafter)
    assert target.capture is None
