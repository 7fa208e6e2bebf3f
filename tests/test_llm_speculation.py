"""Speculative decoding in the batching engine (LLM with a draft model), on the CPU with fake models.

The fake target's greedy next token depends only on (fed token, position), as in test_llm_pipeline.py,
so every greedy output is known in advance; the fake draft agrees with it two times in three (or
always: an oracle). Checked: greedy outputs identical to plain decoding, with stops, max_tokens,
preemption and requests that cannot speculate (penalties) in the same batches; after every step
both caches hold exactly the committed positions; every page comes back; and under sampling the
tokens follow the target's distribution (a chi-square test).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_llm_pipeline import VOCAB, FakeModel, expected, fake_llm, next_token, workload

from tileinfer.engine.engine import Engine
from tileinfer.engine.params import SamplingParams
from tileinfer.engine.speculative import DraftRunner, common_prefix
from tileinfer.kv import BlockManager


def draft_token(token: int, position: int, oracle: bool) -> int:
    t = next_token(token, position)
    return t if oracle or (token + position) % 3 else (t + 1) % VOCAB


def target_logits(token: int, position: int) -> np.ndarray:
    """A peaked distribution: its argmax is next_token(token, position); two runners-up."""
    t = next_token(token, position)
    row = np.full(VOCAB, -4.0, np.float32)
    row[t], row[(t + 1) % VOCAB], row[(t + 2) % VOCAB] = 2.0, 1.0, 0.5
    return row


class FakeTarget(FakeModel):
    """FakeModel plus the verify step: each fed token's argmax (or logits) at its position."""

    def __init__(self, manager, budget, max_verify_tokens=1000):
        super().__init__(manager, budget)
        self.manager = manager
        self.max_verify_tokens = max_verify_tokens
        self.verify_steps = 0
        self.graph_widths = set()

    def verify(self, batch, *, logits="argmax", graph_width=None, drafted=None, meanwhile=None):
        assert drafted is None and meanwhile is None  # a draft model's proposals are on the host
        self.verify_steps += 1
        self.graph_widths.add(graph_width)
        assert sum(len(ids) for _, ids, _ in batch) <= self.max_verify_tokens
        rows = []
        for seq, ids, start in batch:
            assert seq.num_positions >= start + len(ids), "verify positions not reserved"
            assert all(t >= 0 for t in ids)
            for i, t in enumerate(ids):
                rows.append(next_token(t, start + i) if logits == "argmax" else target_logits(t, start + i))
        return np.array(rows, np.int32) if logits == "argmax" else np.stack(rows)


class FakeDraft:
    """A draft Model: step() gives each row's greedy next token after its last id."""

    def __init__(self, num_pages, page_size, oracle=False, max_batch_tokens=16, max_num_seqs=4):
        self.cache = type("Cache", (), {})()
        self.cache.manager = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        self.oracle, self.max_batch_tokens, self.max_num_seqs = oracle, max_batch_tokens, max_num_seqs
        self.tokens: dict[int, dict[int, int]] = {}  # id(seq) -> position -> token written there
        self.longest_rows: list[int] = []  # each step's longest row

    def step(self, batch, sampling=None, *, sample=True):
        assert len(batch) <= self.max_num_seqs and sum(len(ids) for _, ids, _ in batch) <= self.max_batch_tokens
        self.longest_rows.append(max(len(ids) for _, ids, _ in batch))
        out = []
        for seq, ids, start in batch:
            assert seq.num_positions >= start + len(ids), "draft positions not reserved"
            written = self.tokens.setdefault(id(seq), {})
            for i, t in enumerate(ids):
                written[start + i] = t
            out.append(draft_token(ids[-1], start + len(ids) - 1, self.oracle))
        return np.array(out, np.int32)


def spec_llm(*, k=3, oracle=False, num_pages=64, draft_pages=64, max_num_seqs=4, budget=16, max_verify_tokens=1000):
    llm = fake_llm(num_pages=num_pages, max_num_seqs=max_num_seqs, budget=budget, async_scheduling=True)
    target = FakeTarget(llm.scheduler.manager, budget, max_verify_tokens)
    llm.draft = FakeDraft(draft_pages, llm.config.page_size, oracle=oracle, max_batch_tokens=budget,
                          max_num_seqs=max_num_seqs)
    config = dataclasses.replace(llm.config, draft_model="unused-draft", num_draft_tokens=k)
    llm.config, llm.runner, llm.model = config, target, target
    llm.engine = Engine(config, target, llm.tokenizer, llm.eos_token_ids, DraftRunner(llm.draft))
    llm.engine.scheduler.watermark_pages = 0
    llm.scheduler, llm.drafter = llm.engine.scheduler, llm.engine.drafter
    return llm


def check_caches(llm) -> None:
    """Between steps: the target holds each running request's committed tokens but the last, the
    draft a prefix of those (as its pages say)."""
    for req in llm.scheduler.running:
        # Never a position past the committed tokens (a prompt's, or a readmitted request's, positions are
        # all reserved at admission, so a request may hold its last token's position before computing it).
        assert req.seq.num_positions <= req.num_tokens
        if req.spec is not None and req.spec.target_steps and req.num_computed == req.num_tokens - 1 \
                and not req.num_preemptions:
            assert req.seq.num_positions == req.num_computed
    for rid, (seq, fed) in llm.drafter.held.items():
        assert seq.num_positions == len(fed)
        req = next((r for r in llm.scheduler.running + list(llm.scheduler.waiting) if r.request_id == rid), None)
        if req is not None:
            assert len(fed) <= req.num_tokens - 1 and fed == req.token_ids[:len(fed)]
            written = llm.draft.tokens[id(seq)]
            assert [written[p] for p in range(len(fed))] == fed, "the draft's cache holds other tokens"


def run_checked(llm, prompts, params):
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    while llm.has_unfinished_requests():
        llm.step()
        check_caches(llm)
    outs = {o.request_id: o for o in llm.finished_outputs()}
    return [outs[i] for i in ids]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_gives_the_plain_tokens(seed, k):
    prompts, params = workload(seed)
    llm = spec_llm(k=k)
    outs = run_checked(llm, prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        want = expected(p, sp)
        assert o.token_ids == want
        assert o.finish_reason == ("stop" if want[-1] in sp.stop_token_ids else "length")
    stats = [o.speculation for o in outs]
    assert sum(s.drafted for s in stats) > 0 and 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)
    assert llm.scheduler.manager.num_free_pages == 64
    assert llm.draft.cache.manager.num_free_pages == 64 and not llm.drafter.held


def test_an_oracle_draft_is_always_accepted():
    prompts = [[5, 6, 7], [1] * 20, [9]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (13, 9, 21)]
    llm = spec_llm(k=4, oracle=True)
    outs = run_checked(llm, prompts, params)
    assert [o.token_ids for o in outs] == [expected(p, sp) for p, sp in zip(prompts, params)]
    for o, sp in zip(outs, params):
        s = o.speculation
        assert s.accepted == s.drafted > 0
        # rounds of up to 5 tokens, none wasted past max_tokens; the first token comes from the prefill's
        # last chunk, or from a round when that chunk is a single token (the prompt [9])
        assert s.emitted == sp.max_tokens - (len(o.prompt_token_ids) > 1)
        assert s.target_steps == math.ceil(s.emitted / 5)


def test_verify_steps_ask_for_a_graph_of_k_plus_one_tokens_a_row_with_graphs():
    prompts, params = workload(1)
    for on, widths in ((False, {None}), (True, {4})):
        llm = spec_llm(k=3)
        llm.runner.use_graphs = on
        outs = run_checked(llm, prompts, params)
        assert [o.token_ids for o in outs] == [expected(p, sp) for p, sp in zip(prompts, params)]
        assert llm.model.graph_widths == widths


def test_speculation_with_preemption_and_a_full_draft_pool():
    # A target pool that forces preemption, and a draft pool too small for every request at once:
    # requests the draft has no room for decode one token a step; outputs do not change.
    for seed in range(4):
        prompts, params = workload(seed)
        llm = spec_llm(k=3, num_pages=18, draft_pages=12)
        outs = run_checked(llm, prompts, params)
        assert [o.token_ids for o in outs] == [expected(p, sp) for p, sp in zip(prompts, params)]
        assert llm.scheduler.manager.num_free_pages == 18 and llm.draft.cache.manager.num_free_pages == 12
    assert llm.scheduler.num_preemptions > 0


def test_a_verify_step_never_exceeds_its_rows():
    # 4 decoding requests, k = 5, a verify step of at most 10 tokens: proposals are cut to fit.
    prompts, params = workload(21)
    llm = spec_llm(k=5, max_verify_tokens=10)
    outs = run_checked(llm, prompts, params)
    assert [o.token_ids for o in outs] == [expected(p, sp) for p, sp in zip(prompts, params)]
    assert sum(o.speculation.drafted for o in outs) > 0


@pytest.mark.parametrize("unspeculated", [dict(repetition_penalty=1.1), dict(logit_bias={3: -0.5})])
def test_requests_with_penalties_or_a_bias_decode_without_speculating(unspeculated):
    prompts, params = workload(11)
    params = [SamplingParams(max_tokens=sp.max_tokens, temperature=0, ignore_eos=True,
                             stop_token_ids=sp.stop_token_ids, **(unspeculated if i % 2 else {}))
              for i, sp in enumerate(params)]
    llm = spec_llm(k=3)
    outs = run_checked(llm, prompts, params)
    assert [o.token_ids for o in outs] == [expected(p, sp) for p, sp in zip(prompts, params)]
    assert all((o.speculation is None) == (i % 2 == 1) for i, o in enumerate(outs))


def test_sampled_tokens_follow_the_target_distribution():
    # 1,500 requests of one prompt, three tokens each at temperature 1: the first comes from the prefill
    # step (the fake's argmax), the second from a verify round whose proposal is the draft's greedy
    # token (accepted with probability p(x), else a draw from p without x). The second token's
    # frequencies over the three likely tokens and the rest must fit p: chi-square, 3 degrees of
    # freedom, rejected at p < 1e-4 (a correct engine fails one run in 10,000; dropping the residual
    # draw, i.e. always emitting the proposal, gives a statistic in the thousands).
    n, prompt = 1500, [17, 4]
    llm = spec_llm(k=1, oracle=False, max_num_seqs=4)
    params = [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=i) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    first = next_token(prompt[-1], len(prompt) - 1)
    assert all(o.token_ids[0] == first for o in outs)
    row = target_logits(first, len(prompt)).astype(np.float64)
    p = np.exp(row - row.max())
    p /= p.sum()
    t = next_token(first, len(prompt))
    top = [t, (t + 1) % VOCAB, (t + 2) % VOCAB]
    counts = np.array([sum(o.token_ids[1] == x for o in outs) for x in top] + [0.0])
    counts[3] = n - counts[:3].sum()
    want = n * np.array([p[top[0]], p[top[1]], p[top[2]], 1 - p[top].sum()])
    assert sum(o.speculation.drafted for o in outs) == n  # every second token went through a proposal
    chi2 = float(((counts - want) ** 2 / want).sum())
    assert chi2 < 21.1, f"chi-square {chi2:.1f} (3 dof): counts {counts.tolist()}, expected {want.round(1).tolist()}"


def test_a_stream_closed_early_gives_every_draft_page_back():
    prompts, params = workload(31)
    llm = spec_llm(k=3)
    gen = llm.generate_stream(prompts, [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * len(prompts))
    for _ in range(6):
        next(gen)
    assert llm.drafter.held  # drafting was under way
    gen.close()
    outs = llm.generate(prompts[:2], params[:2])  # the next step releases the aborted requests' drafts
    assert [o.token_ids for o in outs] == [expected(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    assert llm.scheduler.manager.num_free_pages == 64 and llm.draft.cache.manager.num_free_pages == 64


def test_short_draft_catch_ups_run_as_decode_steps():
    # Rows of 1-4 tokens (what a round leaves to feed) go through one-token steps that end together
    # (the draft's decode graphs); a row of more goes through the chunked path. Same next tokens.
    from tileinfer.kv import Sequence

    draft = FakeDraft(64, 4, max_batch_tokens=16)
    runner = DraftRunner(draft)
    rows = []
    for n, start in ((1, 5), (2, 9), (4, 0), (3, 2)):
        seq = Sequence()
        draft.cache.manager.reserve(seq, start + n)
        rows.append((seq, [7 * n + i for i in range(n)], start))
    got = runner._run(rows)
    assert draft.longest_rows == [1, 1, 1, 1]
    assert got == [draft_token(ids[-1], start + len(ids) - 1, False) for _, ids, start in rows]
    long_seq = Sequence()
    draft.cache.manager.reserve(long_seq, 20)
    got = runner._run(rows + [(long_seq, list(range(20)), 0)])
    assert max(draft.longest_rows[4:]) > 1 and got[-1] == draft_token(19, 19, False)


def test_draft_rollback_keeps_a_prefix_without_the_last_token():
    draft = FakeDraft(16, 4)
    runner = DraftRunner(draft)
    committed = [3, 1, 4, 1, 5]
    props = runner.propose([(7, committed, 3)]).tokens()[0]
    seq, fed = runner.held[7]
    assert len(props) == 3 and fed == committed + props[:2] and seq.num_positions == len(fed)
    kept = committed + props[:1] + [(props[1] + 1) % VOCAB]  # the second proposal rejected
    runner.rollback(7, kept)
    assert fed == kept[:common_prefix(fed, kept)] and len(fed) == len(committed) + 1 == seq.num_positions
    runner.release(7)
    assert draft.cache.manager.num_free_pages == 16 and not runner.held
