"""The whole engine on the CPU runner (the float32 reference over a paged numpy cache), on the tiny
synthetic checkpoint: the same path a GPU request takes (scheduler, chunked prefill, prefix caching,
preemption, pipelining, speculation, chat), checked against the reference model computed directly."""
from __future__ import annotations

import numpy as np
import pytest

import tileinfer
from tileinfer import LLM, SamplingParams
from tileinfer.chat import common_prefix
from tileinfer.model.chat_template import render_chat
from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.config import preset
from tileinfer.model.reference import ReferenceModel
from tileinfer.model.synthetic import write_checkpoint


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> ReferenceModel:
    return ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-draft")
    write_checkpoint(preset("tiny"), out, seed=1, progress=False)
    return out


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 151_000, n).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def cpu_llm(path, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_context", 256)
    return LLM(path, device="cpu", progress=False, **kw)


def test_greedy_llm_output_equals_the_reference(tiny_checkpoint, reference):
    prompts = prompts_of([5, 70, 1, 33])
    with cpu_llm(tiny_checkpoint, max_num_batched_tokens=48) as llm:  # 70 tokens prefill in two chunks
        outs = llm.generate(prompts, greedy(6))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference.greedy(p, 6)


def test_batched_and_one_at_a_time_give_the_same_tokens(tiny_checkpoint):
    prompts = prompts_of([9, 40, 3, 17, 60], seed=1)
    params = [greedy(5), SamplingParams(max_tokens=5, temperature=1.0, top_k=20, seed=3), greedy(7),
              SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=4, repetition_penalty=1.2), greedy(3)]
    with cpu_llm(tiny_checkpoint) as llm:
        together = [o.token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone


def test_prefix_caching_on_and_off_give_the_same_tokens(tiny_checkpoint):
    shared = prompts_of([130], seed=2)[0]
    prompts = [shared + tail for tail in prompts_of([3, 20, 1], seed=3)]
    with cpu_llm(tiny_checkpoint, page_size=16) as on, cpu_llm(tiny_checkpoint, page_size=16,
                                                               enable_prefix_caching=False) as off:
        on.generate(prompts[:1], greedy(4))  # fills the cache with the shared prefix
        hits = on.generate(prompts, greedy(4))
        plain = off.generate(prompts, greedy(4))
    assert [o.token_ids for o in hits] == [o.token_ids for o in plain]
    assert all(o.num_cached_tokens >= 128 for o in hits) and all(o.num_cached_tokens == 0 for o in plain)


def test_preemption_and_recompute_give_the_same_tokens(tiny_checkpoint):
    prompts = prompts_of([30, 25, 40, 20, 35], seed=5)
    with cpu_llm(tiny_checkpoint, page_size=16) as roomy:
        want = [o.token_ids for o in roomy.generate(prompts, greedy(16))]
    with cpu_llm(tiny_checkpoint, page_size=16, max_context=96, num_pages=9) as tight:  # 144 positions, 4 x 64 wanted
        outs = tight.generate(prompts, greedy(16))
        assert tight.stats.preemptions > 0
        assert tight.runner.cache.manager.num_free_pages == 9
    assert [o.token_ids for o in outs] == want


def test_speculative_greedy_equals_plain_greedy(tiny_checkpoint, draft_checkpoint):
    prompts = prompts_of([12, 50, 4], seed=6)
    with cpu_llm(tiny_checkpoint) as plain:
        want = [o.token_ids for o in plain.generate(prompts, greedy(10))]
    with cpu_llm(tiny_checkpoint, draft_model=draft_checkpoint, num_draft_tokens=3) as spec:
        outs = spec.generate(prompts, greedy(10))
        assert spec.engine.drafter.runner.cache.manager.num_free_pages == \
            spec.engine.drafter.runner.cache.manager.num_pages
    assert [o.token_ids for o in outs] == want
    assert all(o.speculation.target_steps > 0 for o in outs)


def test_generate_and_logits_on_a_cpu_model(tiny_checkpoint, reference):
    model = tileinfer.load_model(tiny_checkpoint, device="cpu")
    prompt = prompts_of([21], seed=7)[0]
    result = tileinfer.generate(model, prompt, max_new_tokens=5, stop_at_eos=False)
    assert result.token_ids == reference.greedy(prompt, 5) and result.finish_reason == "length"
    np.testing.assert_allclose(model.logits(prompt, chunk=8), reference.forward(prompt), rtol=1e-4, atol=1e-4)
    int8 = model.logits(prompt, kv_quantize="int8", chunk=8)
    np.testing.assert_allclose(int8, reference.forward(prompt, reference.new_cache(int8=True, smoothing=True)),
                               rtol=1e-4, atol=1e-4)


def test_generate_over_an_idle_llm_runs_in_its_engine(tiny_checkpoint, reference):
    """generate() takes an idle LLM (the CLI's way with tensor parallelism): its engine and pool run the request;
    the options an LLM takes at creation are refused here, and so is a prompt past its max_context."""
    prompt = prompts_of([21], seed=7)[0]
    with cpu_llm(tiny_checkpoint, max_context=64) as llm:
        result = tileinfer.generate(llm, prompt, max_new_tokens=5, stop_at_eos=False)
        assert result.token_ids == reference.greedy(prompt, 5) and result.finish_reason == "length"
        assert result.prompt_token_ids == prompt and not llm.has_unfinished_requests()
        manager = llm.runner.cache.manager
        assert manager.num_free_pages == manager.num_pages  # nothing held
        with pytest.raises(ValueError, match=r"pass kv_quantize, num_draft_tokens to LLM\(...\) instead"):
            tileinfer.generate(llm, prompt, max_new_tokens=5, kv_quantize="int8", num_draft_tokens=2)
        with pytest.raises(ValueError, match="max_context"):
            tileinfer.generate(llm, prompt, max_new_tokens=60)


def test_logit_bias_forces_and_bans_tokens_and_shifts_the_logits_it_names(tiny_checkpoint):
    prompt = prompts_of([12], seed=9)[0]
    with cpu_llm(tiny_checkpoint) as llm:
        plain = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3))[0]
        forced = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                     logit_bias={4242: 100.0}))[0]
        first = plain.token_ids[0]
        banned = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logit_bias={first: -100.0},
                                                     logprobs=3))[0]
        with pytest.raises(ValueError, match=r"logit_bias: token ids \[151936\] are outside the vocabulary"):
            llm.generate(prompt, SamplingParams(max_tokens=1, logit_bias={151936: 1.0}))
    assert forced.token_ids == [4242] * 6
    assert banned.token_ids[0] != first
    # the rest of the distribution is the plain one: the runner-up (the plain second choice) takes the lead
    runner_up = sorted(plain.logprobs[0], key=plain.logprobs[0].get)[-2]
    assert banned.token_ids[0] == runner_up


def test_llm_chat_replies_to_each_conversation_as_generate_continues_its_rendered_prompt(tiny_checkpoint):
    hi = [{"role": "user", "content": "Hi"}]
    long = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
    tools = [{"type": "function", "function": {"name": "now", "description": "The time.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with cpu_llm(tiny_checkpoint) as llm:
        template = llm.runner.checkpoint.chat_template
        want = llm.generate([render_chat(template, hi), render_chat(template, hi, enable_thinking=False),
                             render_chat(template, long, enable_thinking=False),
                             render_chat(template, hi, tools=tools)], greedy(5))
        one = llm.chat(hi, greedy(5))
        both = llm.chat([hi, long], greedy(5), chat_template_kwargs={"enable_thinking": False})
        with_tools = llm.chat(hi, greedy(5), tools=tools)
        for bad in ([], "Hi", [[]], [hi[0], [hi[0]]]):
            with pytest.raises(ValueError, match="messages must be a conversation"):
                llm.chat(bad)
        with pytest.raises(ValueError, match="cannot set messages"):
            llm.chat(hi, chat_template_kwargs={"messages": []})
    got = one + both + with_tools
    assert [(o.prompt_token_ids, o.token_ids) for o in got] == [(o.prompt_token_ids, o.token_ids) for o in want]
    assert len({tuple(o.prompt_token_ids) for o in want}) == 4  # thinking off and the tools change the prompt


def test_chat_reuses_its_prefix_and_says_what_it_computed(tiny_checkpoint):
    with cpu_llm(tiny_checkpoint, max_context=512) as llm:
        chat = tileinfer.ChatSession(llm, max_context=512, system="Be brief.")
        chat.send("Hello there", max_tokens=6)
        first = chat.last_turn
        assert first.reused_tokens == 0 and first.computed_tokens == first.prompt_tokens
        held = list(chat._cached)  # the first turn's prompt and reply (but its last token)
        assert len(held) == first.prompt_tokens + first.new_tokens - 1
        chat.send("And again", max_tokens=6)
        second = chat.last_turn
        prompt = chat.render(chat.messages[:-1])
        assert second.reused_tokens == common_prefix(held, prompt) > first.prompt_tokens // 2
        assert second.computed_tokens == second.prompt_tokens - second.reused_tokens
        assert chat._seq.num_positions == len(chat._cached)
        assert not llm.has_unfinished_requests()


def test_logprobs_and_stop_strings_on_the_cpu(tiny_checkpoint):
    with cpu_llm(tiny_checkpoint) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and max(entry.values()) == entry[token] and all(v <= 0 for v in entry.values())


def test_min_tokens_bans_the_stop_tokens_and_strings_until_reached(tiny_checkpoint):
    prompt = prompts_of([7], seed=5)[0]
    with cpu_llm(tiny_checkpoint) as llm:
        free = llm.generate([prompt], greedy(12))[0]
        stop = free.token_ids[0]  # the random model's favourite: it comes first and again and again
        early = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
        held = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop],
                                                     min_tokens=4))[0]
        stop_text = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                          stop=free.text[:2], min_tokens=6))[0]
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    assert stop not in held.token_ids[:4] and len(held.token_ids) > 4
    assert held.token_ids[-1] == stop or held.finish_reason == "length"  # allowed again after 4 tokens
    assert len(stop_text.token_ids) >= 6  # the stop string in the first tokens' text did not end it


def test_a_sibling_takes_its_prompt_pages_from_the_first_choice(tiny_checkpoint):
    prompt = prompts_of([150], seed=6)[0]
    with cpu_llm(tiny_checkpoint, page_size=16) as llm:
        engine = llm.engine
        first = engine.make_request(prompt, greedy(5))
        second = engine.make_request(prompt, greedy(5), shares_prompt_with=first)
        engine.add(first)
        engine.add(second)
        for _ in range(100):
            if not engine.has_unfinished:
                break
            engine.step()
        assert not engine.has_unfinished
        a, b = engine.output(first), engine.output(second)
    assert a.token_ids == b.token_ids
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 144  # every full page of the prompt
