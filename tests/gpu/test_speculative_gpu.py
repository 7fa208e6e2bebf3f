"""Speculative decoding on the GPU (tileinfer/engine/speculative.py; the algorithm's CPU tests are
tests/test_speculative.py). The target runs batch-invariant, so a position's logits are bitwise the
same in a verify chunk and in a decode step, and greedy speculation must reproduce plain greedy
decoding token for token."""
from __future__ import annotations

import numpy as np
import pytest

import tileinfer
from tileinfer.engine.speculative import ModelDecoder, ModelDraft, OracleDraft, speculative_decode
from tileinfer.kv import Sequence
from tileinfer.model.config import preset
from tileinfer.model.synthetic import write_checkpoint

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
    target, other, _ = models
    prompt = np.random.default_rng(5).integers(0, 151643, 130).tolist()
    t_dec, d_dec = ModelDecoder(target, target.ensure_cache(400)), ModelDecoder(other, other.ensure_cache(400))
    draft = ModelDraft(d_dec)
    seen = []

    def on_round(committed, accepted):
        # num_positions and block tables: the target holds committed[:-1], the draft a prefix of committed.
        assert t_dec.seq.num_positions == len(committed) - 1
        assert len(t_dec.seq.block_table) == -(-(len(committed) - 1) // t_dec.cache.page_size)
        assert d_dec.seq.num_positions == len(draft.fed) and draft.fed == committed[:len(draft.fed)]
        assert len(d_dec.seq.block_table) == -(-len(draft.fed) // d_dec.cache.page_size)
        seen.append(accepted)

    try:
        out, stats = speculative_decode(t_dec, draft, prompt, max_new_tokens=60, num_draft_tokens=4,
                                        on_round=on_round)
    finally:
        t_dec.release()
        d_dec.release()
    assert len(out) == 60 and len(seen) == stats.target_steps
    assert target.cache.manager.num_free_pages == target.cache.layout.num_pages


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
    # Model.verify(graph_width=5): the step padded to the batch's bucket (3 rows -> 4) x 5 tokens, replayed
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
        assert {key: sorted(g.graphs) for key, g in target.verify_graphs.items()} == {(5, "all"): [4], (5, "argmax"): [4]}
        # A row longer than the graph's width runs eagerly (no new graph).
        seq = seqs[0]
        start = seq.num_positions
        cache.manager.reserve(seq, 7)
        long_row = [(seq, rng.integers(0, 151643, 7).tolist(), start)]
        np.testing.assert_array_equal(target.verify(long_row, logits="all", graph_width=5),
                                      target.verify(long_row, logits="all"))
        assert sorted(target.verify_graphs[(5, "all")].graphs) == [4]
    finally:
        for seq in seqs:
            cache.manager.release(seq)


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


@pytest.mark.parametrize("which, graphs", [("other", False), ("same", False), ("other", True)])
def test_llm_greedy_speculation_equals_plain(tiny_checkpoint, draft_checkpoint, which, graphs, monkeypatch):
    monkeypatch.setenv("TILEINFER_VERIFY_GRAPHS", "1" if graphs else "0")  # verify steps replaying graphs
    prompts = llm_prompts()
    params = [tileinfer.SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (30, 41, 25, 37, 50)]
    kw = dict(max_num_seqs=4, max_context=512, num_pages=64, page_size=16, batch_invariant=True, progress=False)
    with tileinfer.LLM(tiny_checkpoint, **kw) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    draft = draft_checkpoint if which == "other" else tiny_checkpoint
    with tileinfer.LLM(tiny_checkpoint, draft_model=draft, num_draft_tokens=4, **kw) as llm:
        outs = llm.generate(prompts, params)  # 5 requests through 4 rows: one waits, then joins
        assert [o.token_ids for o in outs] == want
        assert llm.scheduler.manager.num_free_pages == 64 and llm.draft.cache.manager.num_free_pages == 64
        r = llm.memory_report
        if r is not None:  # the draft's memory is reported, and the report still adds up
            assert r.draft > 0 and abs(r.unaccounted) < 0.02 * r.total, r.format()
        assert bool(llm.model.verify_graphs) == graphs
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
