"""Structured output (engine/structured.py) on the CPU runner and through the server with the OpenAI
client: on a random-weight checkpoint only the grammar can make the text valid, so every answer that
parses and validates is the grammar's doing. Also the machinery that makes it cheap: a step's masks
computed together, after the step is launched (pipelined steps), equal to one request's masks
computed alone."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import openai
import pytest

import tokenizers

from tileinfer import LLM, SamplingParams
from tileinfer.engine.structured import Grammars, StructuredOutputs
from tileinfer.kv import Sequence
from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.config import preset
from tileinfer.model.synthetic import write_checkpoint
from tileinfer.runner.cpu import CPURunner
from tileinfer.runner.sampler import apply_mask

from test_server import NAME, error_of, serving

SETTINGS = dict(device="cpu", max_num_seqs=16, max_context=512, progress=False)


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    """Nested objects, bounded arrays, enums, bounded numbers and strings with length limits. Numbers are
    multiples of a power of two (a random model could otherwise repeat a decimal digit until max_tokens)."""
    kinds = ["integer", "number", "string", "boolean", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "integer":
        lo = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 200))}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": [0.5, 0.25, 0.125][int(rng.integers(3))]}
    if kind == "string":
        return {"type": "string", "minLength": int(rng.integers(0, 3)), "maxLength": int(rng.integers(3, 10))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": [f"v{i}" for i in range(int(rng.integers(1, 5)))]}
    if kind == "array":
        lo = int(rng.integers(0, 2))
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + int(rng.integers(0, 3))}
    props = {f"k{i}": random_schema(rng, depth + 1) for i in range(int(rng.integers(1, 4)))}
    return {"type": "object", "properties": props, "required": [k for k in props if rng.random() < 0.7],
            "additionalProperties": False}


# ---------------------------------------------------------------------------- the constraint itself
@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
    (dict(regex="a+", choice=["a"]), "got regex, choice"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(json=3), "json is a JSON schema"),
    (dict(regex="a\ud800"), "regex holds a lone UTF-16 surrogate (U+D800 at character 1)"),
    (dict(choice=["yes", "\udfff"]), "choice holds a lone UTF-16 surrogate"),
])
def test_a_malformed_constraint_names_the_problem(kwargs, words):
    with pytest.raises(ValueError, match="structured_outputs") as e:
        StructuredOutputs(**kwargs)
    assert words in str(e.value)


def test_apply_mask_keeps_the_set_bits_only():
    mask = np.zeros(2, np.int32)
    mask[0], mask[1] = 1 | (1 << 3), 1 << 2  # tokens 0, 3 and 34
    row = apply_mask(np.arange(40, dtype=np.float32), mask)
    assert np.flatnonzero(np.isfinite(row)).tolist() == [0, 3, 34] and row[34] == 34


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with LLM(tiny_checkpoint, **SETTINGS) as llm:
        yield llm


def test_every_kind_of_constraint_holds(llm):
    outs = llm.generate(["a", "b", "JSON please", "d"], [
        SamplingParams(max_tokens=20, temperature=0, structured_outputs=StructuredOutputs(choice=["red", "green"])),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                       structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}")),
        SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(json_object=True)),
        SamplingParams(max_tokens=30, temperature=1.0, seed=5, structured_outputs=StructuredOutputs(
            grammar='start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,2}/')),
    ])
    assert outs[0].text in ("red", "green")
    assert len(outs[1].text) >= 6 and outs[1].text[3] == "-" and outs[1].text[:3].isdigit()
    assert isinstance(json.loads(outs[2].text), dict)
    assert outs[3].text in ("yes", "no") or outs[3].text.startswith("maybe ")
    assert all(o.finish_reason == "stop" for o in outs)


def test_sampled_json_objects_parse_whenever_they_end(llm):
    # Any JSON object: a random model may write a string until max_tokens (finish "length", the text cut);
    # every answer that ends does so as a complete object.
    outs = llm.generate(["JSON please"] * 16, [SamplingParams(max_tokens=150, temperature=1.0, seed=i,
                        structured_outputs=StructuredOutputs(json_object=True)) for i in range(16)])
    ended = [o for o in outs if o.finish_reason == "stop"]
    assert len(ended) >= 12 and all(isinstance(json.loads(o.text), dict) for o in ended)


def test_a_mixed_batch_leaves_the_free_requests_alone(llm):
    free = [[5, 6, 7], [100, 200, 300, 400, 500]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(free, params)]
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    mixed = llm.generate(free + ["x", "y"], [params, params] + [SamplingParams(
        max_tokens=30, temperature=1.0, seed=i, structured_outputs=StructuredOutputs(json=schema)) for i in range(2)])
    assert [o.token_ids for o in mixed[:2]] == alone
    assert all(isinstance(json.loads(o.text)["a"], bool) for o in mixed[2:])


def test_a_schema_the_grammar_engine_rejects_is_a_value_error(llm):
    with pytest.raises(ValueError, match="structured_outputs: the grammar engine rejects it"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(json={"type": "objectx"})))
    assert not llm.has_unfinished_requests()


# ---------------------------------------------------------------------------- a step's masks together
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]},
                                           "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["id", "tag", "xs"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(tiny_checkpoint) -> Grammars:
    ckpt = Checkpoint.open(tiny_checkpoint)
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    return Grammars(tokenizer, ckpt.config.vocab_size, ckpt.eos_token_ids)


def allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])


def test_the_short_string_slices_change_no_mask(grammars):
    # Grammars' tokenizer puts SHORT_STRING_SLICES before llguidance's own slices (a speed-up inside strings with
    # a maxLength): along random documents of a schema of bounded strings, every mask equals the one
    # llguidance's default slices give.
    from llguidance import LLMatcher, LLTokenizer
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}},
        "notes": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 25}}},
        "required": ["name", "tags", "notes"], "additionalProperties": False}
    text = StructuredOutputs(json=schema).grammar_text()
    default = LLTokenizer(grammars._tokenizer_json, n_vocab=grammars.vocab_size, eos_token=grammars.eos_token_ids)
    ours = grammars._ll_tokenizer()
    words = grammars.words
    for seed in range(6):
        rng = np.random.default_rng(seed)
        a, b = LLMatcher(default, text, log_level=0), LLMatcher(ours, text, log_level=0)
        ma, mb = np.empty(words, np.int32), np.empty(words, np.int32)
        for _ in range(120):
            a.unsafe_compute_mask_ptr(ma.ctypes.data, ma.nbytes)
            b.unsafe_compute_mask_ptr(mb.ctypes.data, mb.nbytes)
            np.testing.assert_array_equal(ma, mb)
            token = int(rng.choice(allowed(ma, grammars.vocab_size)))
            assert a.consume_token(token) and b.consume_token(token)
            if a.is_stopped():
                break


def test_a_steps_masks_computed_together_equal_each_computed_alone(grammars):
    # Matchers of every kind, each advanced by a different number of random allowed tokens (some to the
    # end of their grammar, one refused into its error state); rows without a matcher allow everything.
    rng = np.random.default_rng(7)
    specs = [StructuredOutputs(json=SCHEMA), StructuredOutputs(json_object=True), StructuredOutputs(regex=r"[a-f]{2,9}x"),
             StructuredOutputs(choice=["alpha", "beta", "gamma"]),
             StructuredOutputs(grammar='start: "n=" NUM ";"\nNUM: /[0-9]{1,4}/')]
    matchers = []
    for k in range(12):
        m = grammars.matcher(specs[k % len(specs)])
        for _ in range(int(rng.integers(0, 12))):
            if m.done:
                break
            ok = allowed(m.mask(), grammars.vocab_size)
            assert grammars.consume([(m, int(rng.choice(ok)))]) == [None]
        matchers.append(m)
    refused = grammars.matcher(specs[0])
    bad = next(t for t in range(1000, 151000) if t not in set(allowed(refused.mask(), grammars.vocab_size)))
    error, = grammars.consume([(refused, bad)])
    assert error and "doesn't satisfy the grammar" in error
    rows = matchers[:5] + [None, refused] + matchers[5:] + [None]
    out = np.full((len(rows), grammars.words), 0x55, np.int32)
    grammars.fill_masks(rows, out)
    for i, m in enumerate(rows):
        np.testing.assert_array_equal(out[i], m.mask() if m is not None else np.full(grammars.words, -1, np.int32),
                                      err_msg=f"row {i}")
    assert len({allowed(out[i], grammars.vocab_size).size for i in range(len(rows))}) > 3  # different states
    with pytest.raises(ValueError, match="C-contiguous int32"):
        grammars.fill_masks(rows, out[:, :-1])


def test_a_masked_cpu_step_samples_only_once_its_masks_are_published(tiny_checkpoint):
    runner = CPURunner(tiny_checkpoint, max_num_seqs=4)
    cache = runner.ensure_cache(256, page_size=16)
    seqs = [Sequence() for _ in range(3)]
    prompts = [[5, 6, 7], [100, 200], [9] * 20]
    for s, p in zip(seqs, prompts):
        cache.manager.reserve(s, len(p))
    words = (runner.config.vocab_size + 31) // 32
    only = np.zeros(words, np.int32)
    only[4242 // 32] = 1 << (4242 % 32)  # one token allowed: 4242
    plain = runner.step(list(zip(seqs, prompts)))
    slot = runner.launch(list(zip(seqs, prompts)), masked=[False, True, False])
    with pytest.raises(RuntimeError, match="waits for its bitmasks"):
        runner.collect(slot, 3)
    # The next step may be launched meanwhile: it runs once this one has sampled, its tokens from those samples.
    for s in seqs:
        cache.manager.reserve(s, 1)
    behind = runner.launch([(s, [0]) for s in seqs], token_src=[0, 1, 2])
    with pytest.raises(RuntimeError, match="bitmasks"):
        runner.collect(behind, 3)
    runner.publish_masks(lambda out: out.__setitem__(0, only))
    got = runner.collect(slot, 3)
    assert got.tolist() == [plain[0], 4242, plain[2]]
    after = runner.collect(behind, 3)
    twins = [Sequence() for _ in prompts]  # the same two steps with the tokens given on the host
    for s, p in zip(twins, prompts):
        cache.manager.reserve(s, len(p))
    runner.step(list(zip(twins, prompts)), masks=[None, only, None])
    for s in twins:
        cache.manager.reserve(s, 1)
    assert runner.step([(s, [int(t)]) for s, t in zip(twins, got)]).tolist() == after.tolist()
    with pytest.raises(RuntimeError, match="no launched step waits for bitmasks"):
        runner.publish_masks(lambda out: None)
    with pytest.raises(ValueError, match=r"bitmask 0 is int32 \(3,\)"):  # checked before anything is launched
        runner.step(list(zip(seqs, prompts)), masks=[None, np.zeros(3, np.int32), None])
    fresh = [Sequence() for _ in prompts]
    for s, p in zip(fresh, prompts):
        cache.manager.reserve(s, len(p))
    assert runner.step(list(zip(fresh, prompts)), masks=[only, None, only]).tolist() == [4242, plain[1], 4242]


def constrained(n: int, seed: int = 0) -> list[SamplingParams]:
    kinds = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=r"[0-9]{2}-[a-z]{3,6}"),
             StructuredOutputs(choice=["yes", "no", "perhaps"])]
    return [SamplingParams(max_tokens=40, temperature=1.0 if i % 2 else 0.0, seed=seed + i,
                           structured_outputs=kinds[i % len(kinds)]) for i in range(n)]


def test_constrained_requests_pipeline_and_give_the_unpipelined_tokens(tiny_checkpoint):
    # Pipelined (the masks of step k computed after it is launched, once step k - 1 is read back) and
    # not (every step read back before the next is planned): the same tokens, each valid.
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], "JSON please", [100, 200, 300], "Code:", [7] * 30, "Hi"]
    params = constrained(4) + [free, free]
    outs = {}
    for async_scheduling in (True, False):
        with LLM(tiny_checkpoint, **SETTINGS, async_scheduling=async_scheduling) as llm:
            ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
            pipelined = 0
            while llm.has_unfinished_requests():
                llm.step()
                pipelined += llm.engine._inflight is not None
            done = {o.request_id: o for o in llm.finished_outputs()}
            outs[async_scheduling] = [done[i] for i in ids]
            assert (pipelined > 10) == async_scheduling, pipelined
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    json0, code, choice, json3 = outs[True][:4]
    assert all(o.finish_reason == "stop" for o in outs[True][:4])
    for o in (json0, json3):
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3,6}", code.text) and choice.text in ("yes", "no", "perhaps")


def test_a_constrained_prompt_of_several_chunks_alone(serve_target):
    # The prompt's chunks before the last sample nothing; the last chunk's step samples under a mask. While
    # the step before it is in flight (pipelined), that mask must be published before waiting for that step.
    prompt = list(range(1000, 1100))
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(regex="[a-z]{3,6}"))
    outs = []
    for budget in (32, 256):  # four chunks; one
        with LLM(serve_target.checkpoint, **serve_target.engine_options(2, 512), max_num_batched_tokens=budget) as llm:
            outs.append(llm.generate(prompt, params)[0])
    assert outs[0].token_ids == outs[1].token_ids and re.fullmatch("[a-z]{3,6}", outs[0].text)


def test_a_request_ended_by_length_beside_a_constrained_one(serve_target):
    # Pipelined, each step is launched while the one before waits for its masks; the CPU runner runs it once
    # they are published. A request that reaches max_tokens at such a launch has given its pages back by then.
    params = [SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputs(regex="[a-z ]{12}")),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]
    prompts = [[5, 6, 7], [9, 10]]
    with LLM(serve_target.checkpoint, **serve_target.engine_options(4, 512)) as llm:
        together = llm.generate(prompts, params)
        alone = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len(together[1].token_ids) == 3 and re.fullmatch("[a-z ]{12}", together[0].text)


def test_a_token_the_grammar_refuses_ends_only_its_request(llm, caplog):
    # A bitmask that (wrongly) allows only a token the grammar refuses: that request ends ("abort",
    # stop reason "grammar"), logged; the other constrained request and the free one are untouched.
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], free)[0].token_ids
    params = constrained(2, seed=3)
    victim = llm.add_request("x", params[0])
    other = llm.add_request("y", params[1])
    free_id = llm.add_request([5, 6, 7], free)
    engine = llm.engine
    victim_req = next(r for r in engine.scheduler.waiting if r.request_id == victim)
    grammars = engine._grammars
    fill, calls = grammars.fill_masks, []

    def sabotaged(matchers, out):
        fill(matchers, out)
        for i, m in enumerate(matchers):
            if m is victim_req.matcher:
                calls.append(i)
                if len(calls) == 3:  # its third token: only a refused one is allowed
                    bad = next(t for t in range(1000, 151000) if not (out[i, t // 32] >> (t % 32)) & 1)
                    out[i] = 0
                    out[i, bad // 32] = 1 << (bad % 32)

    grammars.fill_masks = sabotaged
    try:
        while llm.has_unfinished_requests():
            llm.step()
    finally:
        del grammars.fill_masks
    done = {o.request_id: o for o in llm.finished_outputs()}
    assert len(done[victim].token_ids) == 3  # the refused token is its last (a step launched ahead is dropped)
    assert (done[victim].finish_reason, done[victim].stop_reason) == ("abort", "grammar")
    assert "the grammar refused token" in caplog.text
    assert done[other].finish_reason == "stop" and done[other].text and done[free_id].token_ids == alone


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-draft")
    write_checkpoint(preset("tiny"), out, seed=1, progress=False)
    return out


def test_a_speculating_engine_runs_constrained_requests_without_a_draft(tiny_checkpoint, draft_checkpoint):
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    params = constrained(3, seed=5) + [free]
    prompts = ["JSON please", "a", "b", [5, 6, 7]]
    with LLM(tiny_checkpoint, **SETTINGS) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(tiny_checkpoint, **SETTINGS, draft_model=draft_checkpoint, num_draft_tokens=3) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain  # greedy speculation equals plain greedy; the others alike
    assert all(o.speculation is None for o in outs[:3]) and outs[3].speculation.target_steps > 0
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)


# ---------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def served(serve_target):
    yield from serving(serve_target.checkpoint, serve_target.engine_options(max_num_seqs=16, max_context=512))


def test_hundreds_of_random_schemas_through_the_server_all_validate(served):
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(0)
    schemas = [random_schema(rng) for _ in range(200)]

    def ask(i: int) -> str:
        r = served.client().chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=200,
            temperature=1.0, seed=i, response_format={"type": "json_schema",
                                                      "json_schema": {"name": f"s{i}", "schema": schemas[i]}})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(len(schemas))))
    for schema, answer in zip(schemas, answers):
        jsonschema.validate(json.loads(answer), schema)


def test_json_object_streamed_and_vllm_fields(served):
    client = served.client()
    chunks = list(client.completions.create(model=NAME, prompt="JSON please", max_tokens=80, temperature=0,
                                            stream=True, extra_body={"response_format": {"type": "json_object"}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    if finish == "stop":  # the grammar completed: an object
        assert isinstance(json.loads(text), dict)
    else:  # a random-weight model may keep an unbounded string open until max_tokens (qwen3-0.6b on the GPU does)
        assert finish == "length" and text.startswith("{"), (finish, text[:80])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    chunks = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "JSON please"}], max_tokens=80, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}, stream=True))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), schema)
    r = client.completions.create(model=NAME, prompt="Colour:", max_tokens=10, temperature=1.0, seed=2,
                                  extra_body={"guided_choice": ["cyan", "magenta"]})
    assert r.choices[0].text in ("cyan", "magenta")
    r = client.completions.create(model=NAME, prompt="Code:", max_tokens=10, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{4}"}})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isupper()


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "grammar engine rejects it"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "ask for one structured output"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
])
def test_a_bad_constraint_is_400_naming_it(served, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=5, extra_body=extra)
    err = error_of(e.value)
    assert err["param"] == param and words in err["message"], err
    assert served.client().completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
