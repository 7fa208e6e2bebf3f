"""A DFlash drafter in the engine on the CPU runner: the tiny synthetic target with the dflash-tiny drafter.

Checked: greedy output identical to plain greedy (prompts across page boundaries, a batch, max_tokens that
cut a block short, a stop token inside an accepted block, preemption); every round's drafts identical to
the reference DFlash loop's (model/dflash_reference.py), so the context the engine hands the drafter is the
one z-lab's loop gives it; the drafter's pages all come back; the statistics; a drafter whose drafts always
agree is accepted a whole block at a time; generate, ChatSession and the CLI; the GPU runner refuses it."""
from __future__ import annotations

import numpy as np
import pytest

import tileinfer
from tileinfer import LLM, SamplingParams, cli
from tileinfer.engine.dflash import DFlashDrafter
from tileinfer.kv import Sequence
from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.dflash_reference import dflash_greedy
from tileinfer.model.reference import ReferenceModel
from tileinfer.runner.base import DeviceDrafts, Proposals
from tileinfer.runner.cpu import CPURunner
from tileinfer.runner.cpu_dflash import CPUDFlashRunner
from tileinfer.runner.gpu import GPURunner, _draft_sources
from tileinfer.runner.gpu_dflash import GPUDFlashRunner

BLOCK = 16


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> ReferenceModel:
    return ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 151_000, n).tolist() for n in lengths]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def dflash_llm(target, drafter, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_context", 256)
    return LLM(target, device="cpu", progress=False, draft_model=drafter, **kw)


def record_proposals(drafter: DFlashDrafter) -> dict[int, list[tuple[int, int, list[int]]]]:
    """Log every round's (committed tokens, k, drafts) per request id."""
    log: dict[int, list] = {}
    propose = drafter.propose

    def logged(items):
        out = propose(items)
        for (rid, committed, k), drafts in zip(items, out.tokens()):
            log.setdefault(rid, []).append((len(committed), k, list(drafts)))
        return out
    drafter.propose = logged
    return log


def check_drafter_is_empty(llm: LLM) -> None:
    drafter = llm.engine.drafter
    assert not drafter.held and drafter.manager.num_free_pages == drafter.manager.num_pages


def test_the_cpu_runner_captures_the_states_of_what_it_computes(tiny_checkpoint, reference):
    runner = CPURunner(tiny_checkpoint)
    runner.ensure_cache(200, page_size=16)
    prompt = prompts_of([37], seed=1)[0]
    runner.capture_hidden_states((1, 0))
    seq = Sequence()
    runner.extend(seq, prompt, chunk=16, logits="none")  # three chunks, across page boundaries
    _, want = reference.forward_features(prompt, (1, 0))
    np.testing.assert_allclose(runner.last_features, want, rtol=1e-4, atol=1e-4)
    runner.cache.manager.reserve(seq, 3)
    runner.verify([(seq, [7, 8, 9], 37)])
    cache = reference.new_cache()
    reference.forward(prompt, cache)
    np.testing.assert_allclose(runner.last_features, reference.forward_features([7, 8, 9], (1, 0), cache)[1],
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not distinct layers"):
        runner.capture_hidden_states((0, 2))
    runner.capture_hidden_states(())
    with pytest.raises(RuntimeError, match="capture_hidden_states"):
        runner.last_features


def test_greedy_with_dflash_is_plain_greedy_and_drafts_as_the_reference_loop(tiny_checkpoint, dflash_tiny_checkpoint,
                                                                             reference):
    # Four requests in one batch, on pages of 16 positions: prompts and outputs cross page boundaries.
    prompts, n = prompts_of([12, 70, 4, 33], seed=2), 24
    with dflash_llm(tiny_checkpoint, dflash_tiny_checkpoint, page_size=16) as llm:
        assert isinstance(llm.engine.drafter, DFlashDrafter) and llm.config.num_draft_tokens == BLOCK - 1
        log = record_proposals(llm.engine.drafter)
        outs = llm.generate(prompts, greedy(n))
        check_drafter_is_empty(llm)
        drafter = llm.engine.drafter.runner.model
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference.greedy(prompt, n)
        rounds = []  # the reference loop's drafts, round by round
        draft = drafter.draft
        drafter.draft = lambda *a: rounds.append(draft(*a)) or rounds[-1]
        try:
            tokens, lengths = dflash_greedy(reference, drafter, prompt, n)
        finally:
            del drafter.draft
        engine_rounds = log[out.request_id]
        assert [drafts for _, k, drafts in engine_rounds if k] == rounds
        assert tokens == out.token_ids
        s = out.speculation
        assert s.target_steps == len(lengths) == len(engine_rounds)
        assert s.drafted == sum(k for _, k, _ in engine_rounds) and s.accepted == sum(lengths) - len(lengths)
        assert s.emitted == n - 1  # the first token comes from the prompt's step
        # a round drafts a whole block's worth, or what max_tokens leaves (one token fewer than it wants)
        assert [k for _, k, _ in engine_rounds] == [min(BLOCK - 1, n - (c - len(prompt)) - 1)
                                                     for c, _, _ in engine_rounds]


def test_max_tokens_and_num_draft_tokens_shorten_the_block(tiny_checkpoint, dflash_tiny_checkpoint, reference):
    prompts = prompts_of([9, 20, 6], seed=3)
    with dflash_llm(tiny_checkpoint, dflash_tiny_checkpoint, num_draft_tokens=4) as llm:
        log = record_proposals(llm.engine.drafter)
        outs = llm.generate(prompts, [greedy(3), greedy(11), greedy(1)])  # the last ends with its prompt's step
        check_drafter_is_empty(llm)
    assert [o.token_ids for o in outs] == [reference.greedy(p, n) for p, n in zip(prompts, (3, 11, 1))]
    assert outs[2].speculation.target_steps == 0 and outs[2].request_id not in log
    assert max(k for rounds in log.values() for _, k, _ in rounds) == 4
    assert [k for _, k, _ in log[outs[0].request_id]] == [1, 0]  # 3 tokens: the prompt's, then k = 1, then 0
    with pytest.raises(ValueError, match="num_draft_tokens 16 exceeds what the DFlash drafter drafts a round"):
        dflash_llm(tiny_checkpoint, dflash_tiny_checkpoint, num_draft_tokens=16)


def oracle(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> None:
    """Make the drafter's runner draft each request's known continuation (the engine's bookkeeping of its
    context and pages, and the drafter's forward, stay the real ones)."""
    rest = {tuple(p + c[:i]): c[i:] for p, c in zip(prompts, continuations) for i in range(1, len(c) + 1)}
    drafter = llm.engine.drafter
    draft = drafter.runner.draft

    def drafts(rows):
        draft(rows)
        out = []
        for row in rows:
            rid = next(r for r, ctx in drafter.held.items() if ctx.seq is row.seq)
            req = next(q for q in llm.engine.scheduler.running if q.request_id == rid)
            out.append(rest[tuple(req.token_ids)][:len(row.block) - 1])
        return Proposals.of(out)
    drafter.runner.draft = drafts


def first_seen_inside_the_first_block(tokens: list[int]) -> int:
    """The index (2..15) of a token seen there first: a stop the first round's block holds past its start."""
    return next(i for i in range(2, BLOCK) if tokens[i] not in tokens[:i])


def test_an_agreeing_drafter_is_accepted_a_whole_block_at_a_time_and_a_stop_inside_one_ends_it(
        tiny_checkpoint, dflash_tiny_checkpoint, reference):
    prompts = prompts_of([10, 40], seed=6)  # the second continuation has a new token at index 6
    want = [reference.greedy(p, 40) for p in prompts]
    at = first_seen_inside_the_first_block(want[1])
    with dflash_llm(tiny_checkpoint, dflash_tiny_checkpoint) as llm:
        oracle(llm, prompts, want)
        outs = llm.generate(prompts, [greedy(40), greedy(40, stop_token_ids=[want[1][at]])])
        check_drafter_is_empty(llm)
    assert outs[0].token_ids == want[0] and outs[0].finish_reason == "length"
    s = outs[0].speculation
    assert s.accepted == s.drafted == 15 + 15 + 6 and s.target_steps == 3  # 1 + 16 + 16 + 7 tokens
    assert outs[1].token_ids == want[1][:at + 1] and outs[1].finish_reason == "stop"
    # the round accepted its whole block (the statistics count it before the stop cuts the output)
    assert outs[1].speculation == type(s)(drafted=15, accepted=15, target_steps=1, emitted=16)


def test_drafts_that_always_agree_give_blocks_of_block_size(tiny_checkpoint, dflash_tiny_checkpoint):
    # Zero final norms: target and drafter logits are all 0, both argmaxes token 0, so every draft is
    # accepted, through the real drafter forward. Each round emits block_size tokens.
    with dflash_llm(tiny_checkpoint, dflash_tiny_checkpoint) as llm:
        llm.runner.reference.norm[:] = 0
        llm.engine.drafter.runner.model.norm[:] = 0
        out = llm.generate(prompts_of([5], seed=5), greedy(1 + 2 * BLOCK + 3))[0]
        check_drafter_is_empty(llm)
    s = out.speculation
    assert out.token_ids == [0] * (1 + 2 * BLOCK + 3)
    assert s.target_steps == 3 and s.accepted == s.drafted == 2 * (BLOCK - 1) + 2
    assert s.tokens_per_target_step == (2 * BLOCK + 3) / 3


def test_preemption_and_sampling_with_dflash(tiny_checkpoint, dflash_tiny_checkpoint, reference):
    prompts = prompts_of([30, 25, 40, 20], seed=6)
    with dflash_llm(tiny_checkpoint, dflash_tiny_checkpoint, page_size=16, max_context=96, num_pages=9) as llm:
        outs = llm.generate(prompts, greedy(16))
        assert llm.stats.preemptions > 0 and llm.runner.cache.manager.num_free_pages == 9
        check_drafter_is_empty(llm)
        sampled = llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True))
        check_drafter_is_empty(llm)
    assert [o.token_ids for o in outs] == [reference.greedy(p, 16) for p in prompts]
    assert all(len(o.token_ids) == 8 and o.speculation.drafted > 0 for o in sampled)


def test_generate_and_chat_with_a_loaded_dflash_drafter(tiny_checkpoint, dflash_tiny_checkpoint, reference):
    model = tileinfer.load_model(tiny_checkpoint, device="cpu")
    drafter = tileinfer.load_model(dflash_tiny_checkpoint, device="cpu")
    assert isinstance(drafter, CPUDFlashRunner)
    prompt = prompts_of([21], seed=8)[0]
    result = tileinfer.generate(model, prompt, max_new_tokens=12, stop_at_eos=False, draft_model=drafter)
    assert result.token_ids == reference.greedy(prompt, 12) and result.speculation.drafted > 0
    plain = tileinfer.ChatSession(model, max_context=256, system="S")
    want = [plain.send(m, max_tokens=6) for m in ("Hello there", "And again")]
    plain.close()
    chat = tileinfer.ChatSession(model, max_context=256, system="S", draft_model=drafter)
    assert [chat.send(m, max_tokens=6) for m in ("Hello there", "And again")] == want
    assert chat.last_turn.speculation.target_steps > 0 and chat.last_turn.reused_tokens > 0
    chat.close()
    assert drafter.cache.manager.num_free_pages == drafter.cache.manager.num_pages


def test_the_cli_runs_a_dflash_drafter_on_the_cpu(tiny_checkpoint, dflash_tiny_checkpoint, capsys):
    rc = cli.main(["generate", "--model", str(tiny_checkpoint), "--draft-model", str(dflash_tiny_checkpoint),
                   "--device", "cpu", "--prompt", "Hello", "--max-new-tokens", "5", "--max-context", "64"])
    err = capsys.readouterr().err
    assert rc == 0 and "drafts accepted" in err, err
    rc = cli.main(["generate", "--model", str(tiny_checkpoint), "--draft-model", str(dflash_tiny_checkpoint),
                   "--device", "cpu", "--num-draft-tokens", "16", "--prompt", "Hello"])
    err = capsys.readouterr().err
    assert rc == 1 and "--num-draft-tokens 16 exceeds what the DFlash drafter drafts a round" in err, err


def test_a_dflash_drafter_loads_for_the_gpu_without_touching_it(tiny_checkpoint, dflash_tiny_checkpoint):
    # load_model reads the checkpoint only (its weights go up when it is paired with a GPU model); it drafts
    # for a model on its own device and is no model of its own.
    drafter = tileinfer.load_model(dflash_tiny_checkpoint, device="cuda")
    assert isinstance(drafter, GPUDFlashRunner) and drafter.config.target_layer_ids == (0, 1)
    with pytest.raises(RuntimeError, match=r"bind_target\(\) first"):
        drafter.draft([])
    cpu_target = tileinfer.load_model(tiny_checkpoint, device="cpu")
    with pytest.raises(ValueError, match="drafts for a GPU model"):
        drafter.bind_target(cpu_target)
    with pytest.raises(ValueError, match="a DFlash drafter is not a model of its own"):
        GPURunner(dflash_tiny_checkpoint)
    with pytest.raises(ValueError, match="a DFlash drafter"):
        LLM(dflash_tiny_checkpoint, device="cpu", progress=False)  # a drafter is no model of its own


def test_a_context_the_drafters_pool_has_no_room_for_is_left_out(tiny_checkpoint, dflash_tiny_checkpoint):
    # A pool of two pages of 16 entries: one request's 20 context positions fill it, a second request's are
    # left out (drafting goes on without them) and it drafts nothing while there is no room for its block. A
    # context the runner refuses leaves nothing behind.
    target = CPURunner(tiny_checkpoint)
    target.ensure_cache(256, page_size=16)
    drafter = DFlashDrafter(CPUDFlashRunner(dflash_tiny_checkpoint), target)
    target.capture_hidden_states(drafter.target_layer_ids)
    drafter.runner.attach_cache(drafter.runner.new_cache(num_pages=2, page_size=16))
    prompt = prompts_of([20], seed=4)[0]
    target.extend(Sequence(), prompt, logits="none")
    drafter.add_context([(1, 0, 0, 20), (2, 0, 0, 20)])
    assert drafter.held[1].positions == list(range(20)) and drafter.held[2].positions == []
    assert drafter.propose([(2, prompt + [5], 3)]).tokens() == [[]]
    drafter.release(1)
    drafts = drafter.propose([(2, prompt + [5], 3)]).tokens()[0]
    assert len(drafts) == 3 and drafter.held[2].seq.num_positions == 0
    drafter.release(2)
    assert drafter.manager.num_free_pages == 2
    with pytest.raises(ValueError, match=r"rows 15\.\.34 of a step of 20"):  # rows the last step does not have
        drafter.add_context([(3, 0, 15, 20)])
    assert drafter.held[3].positions == [] and drafter.manager.num_free_pages == 2


def test_greedy_rounds_let_the_drafter_draft_the_next_blocks_ahead(tiny_checkpoint, dflash_tiny_checkpoint):
    # After each greedy round's context pass the runner is offered the next round's blocks (GPUDFlashRunner
    # launches them before the host reads the round; the CPU runner waits for draft()): one row a request, in
    # the verify step's row order, each with the drafts it checked and a block of num_draft_tokens + 1. Sampled
    # rounds decide on the host, so nothing is offered after them.
    for temperature in (0, 0.8):
        with dflash_llm(tiny_checkpoint, dflash_tiny_checkpoint, num_draft_tokens=5) as llm:
            calls = []
            llm.engine.drafter.runner.draft_ahead = lambda rows: calls.append([(r, r.seq.num_positions) for r in rows])
            params = SamplingParams(max_tokens=12, temperature=temperature, seed=1, ignore_eos=True)
            llm.generate(prompts_of([30, 47], seed=2), params)
        if temperature:
            assert calls == []
            continue
        assert calls and {len(rows) for rows in calls} <= {1, 2}
        for rows in calls:
            src = 0
            for row, held in rows:
                assert row.src == src and row.count == 6 and 0 <= row.m <= 5
                assert held == row.entry + row.m + 1  # the context ends with the step's entries
                src += row.m + 1


def test_proposals_spread_over_their_requests_and_are_read_once():
    # A drafter's rows are the requests it drafted for; the engine's view has every request, in order.
    reads = []

    def read():
        reads.append(1)
        return [[5, 6], [7]]
    rows = Proposals([2, 1], read=read, device=DeviceDrafts("ids", [0, 3]))
    spread = rows.spread([1, 3], 4)
    assert spread.counts == [0, 2, 0, 1] and spread.device.first == [-1, 0, -1, 3] and spread.device.ids == "ids"
    assert spread.tokens() == [[], [5, 6], [], [7]] == spread.tokens() and reads == [1]
    assert Proposals.of([[1, 2], []]).spread([0, 2], 3).tokens() == [[1, 2], [], []]
    with pytest.raises(RuntimeError, match=r"drafts of \[1\] tokens read back for rows that have \[2\]"):
        Proposals([2], read=lambda: [[1]]).tokens()
    with pytest.raises(ValueError, match="not both"):
        Proposals([1], values=[[1]], read=read)


def test_a_verify_steps_drafts_are_found_by_their_rows():
    # GPURunner.verify(drafted=...): row i's proposal j sits at token row (row i's first) + j of the step and at
    # drafted.ids[first[i] + j] (the drafter's block argmaxes, one request's block after another).
    batch = [(None, [9, 0, 0, 0], 5), (None, [4], 8), (None, [7, 0], 2)]
    rows, sources = _draft_sources(batch, DeviceDrafts("ids", [0, -1, 16]))
    assert rows.tolist() == [1, 2, 3, 6] and sources.tolist() == [1, 2, 3, 17]
    with pytest.raises(ValueError, match="drafts placed for 2 rows, the step has 3"):
        _draft_sources(batch, DeviceDrafts("ids", [0, 16]))
    with pytest.raises(ValueError, match="a row of 1 proposals has none drafted on the device"):
        _draft_sources(batch, DeviceDrafts("ids", [0, -1, -1]))
