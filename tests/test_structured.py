"""Structured output (engine/structured.py) on the CPU runner and through the server with the OpenAI
client: on a random-weight checkpoint only the grammar can make the text valid, so every answer that
parses and validates is the grammar's doing."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest

from tileinfer import LLM, SamplingParams
from tileinfer.engine.structured import StructuredOutputs
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
    assert isinstance(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), dict)
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
