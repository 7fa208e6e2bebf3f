"""Apertus without a GPU: xIELU and the llama3 RoPE table against direct formulas, the reference forward
against an independent numpy model of transformers' ApertusForCausalLM, config.json parsing, checkpoint
loading, the synthetic checkpoint's files and chat template, the engine on the CPU runner, the GPU guard."""
from __future__ import annotations

import json
import math
import shutil

import ml_dtypes
import numpy as np
import pytest

import tileinfer
from tileinfer import LLM, SamplingParams
from tileinfer.chat import render_chat
from tileinfer.model import apertus_tokenizer as tok
from tileinfer.model.checkpoint import Checkpoint, CheckpointError, expected_tensors
from tileinfer.model.config import (
    ApertusConfig, ConfigError, Llama3RopeScaling, config_from_dict, preset, read_config,
)
from tileinfer.model.reference import (
    ReferenceModel, llama3_inv_freq, rope_inv_freq, rope_table, weight_shapes, xielu,
)
from tileinfer.model.safetensors_io import SafetensorsFile, write_safetensors

# transformers' XIELUActivation initial values, as stored: alpha_p = softplus^-1(0.8), alpha_n = softplus^-1(0.3).
INIT = dict(alpha_p=math.log(math.expm1(0.8)), alpha_n=math.log(math.expm1(0.3)), beta=0.5, eps=-1e-6)

# Small, with every dimension different; original_max_position_embeddings keeps its 8192, so head_dim 16 at
# theta 12e6 puts frequencies in all three llama3 bands (checked below).
SMALL = ApertusConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)


# ------------------------------------------------------------------------------------------- xIELU

def xielu_by_hand(x: float, alpha_p: float, alpha_n: float, beta: float, eps: float) -> float:
    return xielu_terms(x, alpha_p, alpha_n, beta, eps)[0]


def xielu_terms(x: float, alpha_p: float, alpha_n: float, beta: float, eps: float) -> tuple[float, float]:
    """(f(x), the size of the terms it sums), in float64 with the math module."""
    a_p = math.log1p(math.exp(alpha_p))
    a_n = beta + math.log1p(math.exp(alpha_n))
    if x > 0:
        terms = (a_p * x * x, beta * x)
    else:
        terms = ((math.expm1(min(x, eps)) - x) * a_n, beta * x)
    return sum(terms), abs(terms[0]) + abs(terms[1])


AWKWARD = [-1e4, -80.0, -3.0, -1.0, -1e-3, -2e-6, -1e-6, -5e-7, -1e-9, -0.0, 0.0, 1e-9, 1e-6, 1e-3, 0.5, 1.0,
           3.0, 20.0, 300.0]


@pytest.mark.parametrize("params", [INIT, dict(alpha_p=-2.0, alpha_n=1.5, beta=0.25, eps=-1e-2),
                                    dict(alpha_p=25.0, alpha_n=-30.0, beta=-0.1, eps=-0.5)])
def test_xielu_matches_the_formula_at_awkward_values(params):
    x = np.array(AWKWARD, np.float32)
    out = xielu(x, *(np.float32(params[k]) for k in ("alpha_p", "alpha_n", "beta", "eps")))
    # the formula in float64 on the float32 inputs and parameters the function sees; float32 may lose a few
    # ulps of the terms' size where they cancel (x = -1e4 with a_n = beta: 1000 - 999.9)
    p32 = {k: float(np.float32(v)) for k, v in params.items()}
    expected, size = np.array([xielu_terms(float(v), **p32) for v in x]).T
    assert out.dtype == np.float32 and out.shape == x.shape
    assert np.all(np.abs(out - expected) <= 4 * np.finfo(np.float32).eps * size + 1e-30), (out, expected)


def test_xielu_at_transformers_initial_values():
    f = xielu(np.array([1.0, 2.0, 0.0, -100.0], np.float32), *map(np.float32, INIT.values()))
    # a_p = 0.8, a_n = 0.8: f(1) = 0.8 + 0.5, f(2) = 3.2 + 1, f(0) = expm1(eps) * 0.8, f(-100) = 99 * 0.8 - 50
    np.testing.assert_allclose(f, [1.3, 4.2, math.expm1(-1e-6) * 0.8, 99 * 0.8 - 50], rtol=1e-5)


# ------------------------------------------------------------------------------------------- RoPE

def llama3_by_hand(head_dim, theta, factor, low, high, original) -> list[float]:
    out = []
    for i in range(0, head_dim, 2):
        freq = theta ** (-i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (128, 12e6, Llama3RopeScaling()),                                   # Apertus-8B and -70B
    (64, 5e5, Llama3RopeScaling(32.0, 1.0, 4.0, 8192)),                 # Llama 3.2's
    (16, 12e6, Llama3RopeScaling(8.0, 2.0, 3.0, 4096)),
])
def test_llama3_table_matches_the_formula(head_dim, theta, scaling):
    table = llama3_inv_freq(head_dim, theta, scaling)
    expected = llama3_by_hand(head_dim, theta, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                              scaling.original_max_position_embeddings)
    assert table.dtype == np.float32 and table.shape == (head_dim // 2,)
    np.testing.assert_allclose(table, expected, rtol=1e-6)
    plain = rope_inv_freq(head_dim, theta)
    kept, divided = np.isclose(table, plain, rtol=1e-6), np.isclose(table, plain / scaling.factor, rtol=1e-6)
    blended = ~kept & ~divided
    assert kept[0] and divided[-1] and kept.sum() + divided.sum() + blended.sum() == head_dim // 2
    assert np.all((table[blended] < plain[blended]) & (table[blended] > plain[blended] / scaling.factor))
    assert np.all(np.diff(table) < 0)   # still one frequency per pair, decreasing


def test_apertus_8b_table_has_all_three_bands_and_rope_table_chooses_it():
    c = preset("apertus-8b")
    table, plain = rope_table(c), rope_inv_freq(128, 12e6)
    kept = np.isclose(table, plain, rtol=1e-6)
    divided = np.isclose(table, plain / 8, rtol=1e-6)
    assert kept.sum() > 0 and divided.sum() > 0 and (~kept & ~divided).sum() > 0
    np.testing.assert_array_equal(rope_table(SMALL), llama3_inv_freq(16, 12e6, Llama3RopeScaling()))
    np.testing.assert_array_equal(rope_table(preset("qwen3-8b")), rope_inv_freq(128, 1e6))
    small_bands = np.isclose(rope_table(SMALL), rope_inv_freq(16, 12e6), rtol=1e-6)
    assert small_bands.any() and not small_bands.all()


# ------------------------------------------------------------------------------------------- reference

def random_weights(config: ApertusConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights with O(1) activations; each layer's xIELU scalars different."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if ".act_fn." in name:
            base = INIT[name.rsplit(".", 1)[1]]
            spread = 0.0 if name.endswith("eps") else 0.3
            weights[name] = np.full(shape, base + spread * rng.standard_normal(), np.float32)
        elif len(shape) == 1:
            weights[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return weights


def rope_complex(x, positions, freq):
    """Rotate-half RoPE as complex multiplication: channel pair (i, i + hd/2) is one complex number."""
    hd = x.shape[-1]
    z = x[..., :hd // 2].astype(np.float64) + 1j * x[..., hd // 2:]
    z = z * np.exp(1j * np.asarray(positions, np.float64)[:, None, None] * np.asarray(freq, np.float64))
    return np.concatenate([z.real, z.imag], axis=-1)


def hf_apertus_forward(c: ApertusConfig, w: dict, ids, positions, freq) -> np.ndarray:
    """transformers' ApertusForCausalLM written out in float64 with per-head loops: embed -> per layer
    [attention_layernorm -> q/k/v -> q_norm/k_norm -> RoPE -> causal GQA -> o_proj -> residual;
    feedforward_layernorm -> up -> xIELU -> down -> residual] -> norm -> lm_head."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    H, KV, hd, n = c.num_attention_heads, c.num_key_value_heads, c.head_dim, len(ids)

    def norm(x, weight):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + c.rms_norm_eps) * weight

    h = w["model.embed_tokens.weight"][ids]
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = norm(h, w[p + "attention_layernorm.weight"])
        q = norm((x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, H, hd), w[p + "self_attn.q_norm.weight"])
        k = norm((x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, KV, hd), w[p + "self_attn.k_norm.weight"])
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, KV, hd)
        q, k = rope_complex(q, positions, freq), rope_complex(k, positions, freq)
        attn = np.zeros((n, H, hd))
        for i in range(n):
            for head in range(H):
                s = k[:i + 1, head // (H // KV)] @ q[i, head] / math.sqrt(hd)
                prob = np.exp(s - s.max())
                attn[i, head] = (prob / prob.sum()) @ v[:i + 1, head // (H // KV)]
        h = h + attn.reshape(n, H * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "feedforward_layernorm.weight"])
        scalars = {name: float(w[p + "mlp.act_fn." + name].reshape(())) for name in INIT}
        up = x @ w[p + "mlp.up_proj.weight"].T
        act = np.vectorize(lambda value: xielu_by_hand(value, **scalars))(up)
        h = h + act @ w[p + "mlp.down_proj.weight"].T
    return norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def small_weights():
    return random_weights(SMALL, seed=4)


def test_reference_forward_matches_transformers_structure(small_weights):
    ids = np.random.default_rng(5).integers(0, SMALL.vocab_size, 11)
    positions = 500 * np.arange(11)  # far apart, so that the scaled low frequencies turn visibly
    freq = llama3_by_hand(16, 12e6, 8.0, 1.0, 4.0, 8192)
    expected = hf_apertus_forward(SMALL, small_weights, ids, positions, freq)
    out = ReferenceModel(SMALL, small_weights).forward(ids, positions=positions)
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-4)
    # The test can tell the tables apart: plain RoPE gives other logits.
    plain = hf_apertus_forward(SMALL, small_weights, ids, positions, rope_inv_freq(16, 12e6))
    assert np.abs(plain - expected).max() > 1e-2


def test_each_layer_uses_its_own_xielu_scalars(small_weights):
    ids = [3, 14, 15, 92]
    changed = dict(small_weights)
    changed["model.layers.1.mlp.act_fn.alpha_n"] = small_weights["model.layers.1.mlp.act_fn.alpha_n"] + 1
    a, b = ReferenceModel(SMALL, small_weights).forward(ids), ReferenceModel(SMALL, changed).forward(ids)
    assert np.abs(a - b).max() > 1e-3


def test_qwen3_names_do_not_load_as_apertus(small_weights):
    qwen_like = {k.replace("attention_layernorm", "input_layernorm"): v for k, v in small_weights.items()}
    with pytest.raises(ValueError, match="model.layers.0.attention_layernorm.weight"):
        ReferenceModel(SMALL, qwen_like)


# ------------------------------------------------------------------------------------------- config.json

# Apertus-8B-Instruct-2509's config.json (transformers 4.56), keys transformers' Apertus ignores included.
PUBLISHED_8B = {
    "architectures": ["ApertusForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "dtype": "bfloat16", "eos_token_id": 68, "hidden_act": "xielu", "hidden_dropout": 0.0, "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 21504, "max_position_embeddings": 65536, "mlp_bias": False,
    "model_type": "apertus", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pad_token_id": 3, "post_norm": False, "qk_norm": True, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3", "type": "llama3"},
    "rope_theta": 12000000, "tie_word_embeddings": False, "transformers_version": "4.56.0", "use_cache": True,
    "vocab_size": 131072,
}


def test_published_8b_config_is_the_preset():
    assert config_from_dict(PUBLISHED_8B) == preset("apertus-8b")


def test_transformers_5_rope_parameters_and_defaults():
    v5 = {k: v for k, v in PUBLISHED_8B.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**PUBLISHED_8B["rope_scaling"], "rope_theta": 12000000.0}
    assert config_from_dict(v5) == preset("apertus-8b")
    bare = {k: v for k, v in v5.items() if k != "rope_parameters"}  # transformers' default: llama3, theta 12e6
    assert config_from_dict(bare) == preset("apertus-8b")
    plain = {**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert config_from_dict(plain).rope_scaling is None and config_from_dict(plain).rope_theta == 5e5


@pytest.mark.parametrize("name", ["apertus-tiny", "apertus-8b", "apertus-70b"])
def test_presets_round_trip_through_config_json(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(preset(name).to_hf_dict()))
    assert read_config(tmp_path) == preset(name)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "silu"}, "hidden_act 'silu' is not supported for Apertus"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported for Apertus"),
    ({"architectures": ["ApertusForTokenClassification"]}, "lacks 'ApertusForCausalLM'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"rope_scaling": {**PUBLISHED_8B["rope_scaling"], "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "high_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "llama3 rope scaling needs low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ({"model_type": "llama"}, "'qwen3' and 'apertus' models only"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**PUBLISHED_8B, **change})


@pytest.mark.parametrize("name", ["apertus-8b", "apertus-70b"])
def test_parameter_count_is_the_tensors(name):
    c = preset(name)
    assert sum(math.prod(shape) for shape in expected_tensors(c).values()) == c.num_parameters()
    layer = {k: v for k, v in expected_tensors(c).items() if k.startswith("model.layers.0.mlp.")}
    assert layer == {"model.layers.0.mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                     "model.layers.0.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                     "model.layers.0.mlp.act_fn.alpha_p": (1,), "model.layers.0.mlp.act_fn.alpha_n": (1,),
                     "model.layers.0.mlp.act_fn.beta": (), "model.layers.0.mlp.act_fn.eps": ()}


def test_qwen3_still_refuses_rope_scaling():
    raw = {**preset("qwen3-8b").to_hf_dict(), "rope_scaling": PUBLISHED_8B["rope_scaling"]}
    with pytest.raises(ConfigError, match="not supported for Qwen3"):
        config_from_dict(raw)


# ------------------------------------------------------------------------------------------- checkpoint

def test_synthetic_checkpoint_layout(apertus_tiny_checkpoint):
    d = apertus_tiny_checkpoint
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["ApertusForCausalLM"] and config["model_type"] == "apertus"
    assert config["hidden_act"] == "xielu" and config["rope_theta"] == 12e6 and config["pad_token_id"] == 3
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 68
    weights = SafetensorsFile(d / "model.safetensors")
    assert list(weights.tensors) == list(expected_tensors(preset("apertus-tiny")))
    assert weights.tensors["model.layers.1.mlp.act_fn.alpha_p"].shape == (1,)
    assert weights.tensors["model.layers.1.mlp.act_fn.eps"].shape == ()
    assert not any("gate_proj" in name or "input_layernorm" in name for name in weights.tensors)
    ckpt = Checkpoint.open(d)
    assert ckpt.config == preset("apertus-tiny") and ckpt.eos_token_ids == [68]
    assert ckpt.chat_template == tok.CHAT_TEMPLATE
    assert float(ckpt.read("model.layers.0.mlp.act_fn.beta")) == 0.5
    alphas = [float(ckpt.read(f"model.layers.{i}.mlp.act_fn.alpha_p")[0]) for i in range(2)]
    assert alphas[0] != alphas[1] and all(abs(a - INIT["alpha_p"]) < 0.5 for a in alphas)


def rewrite(directory, change):
    file = SafetensorsFile(directory / "model.safetensors")
    tensors = {name: np.array(file.read(name)) for name in file.tensors}
    del file
    change(tensors)
    write_safetensors(directory / "model.safetensors", tensors)


def test_missing_xielu_scalar_is_named(apertus_tiny_checkpoint, tmp_path):
    d = shutil.copytree(apertus_tiny_checkpoint, tmp_path / "ckpt")
    rewrite(d, lambda t: t.pop("model.layers.1.mlp.act_fn.beta"))
    with pytest.raises(CheckpointError,
                       match=r"missing tensor 'model.layers.1.mlp.act_fn.beta'; is this a checkpoint of Apertus"):
        Checkpoint.open(d)


def test_scalars_stored_as_one_element_vectors_load_the_same(apertus_tiny_checkpoint, tmp_path):
    d = shutil.copytree(apertus_tiny_checkpoint, tmp_path / "ckpt")

    def as_vectors(t):
        for i in range(2):
            for name in ("beta", "eps"):
                t[f"model.layers.{i}.mlp.act_fn.{name}"] = t[f"model.layers.{i}.mlp.act_fn.{name}"].reshape(1)
    rewrite(d, as_vectors)
    ids = [1, 65, 120, 66, 67]
    a = ReferenceModel.from_checkpoint(Checkpoint.open(apertus_tiny_checkpoint)).forward(ids)
    np.testing.assert_array_equal(ReferenceModel.from_checkpoint(Checkpoint.open(d)).forward(ids), a)


def test_a_qwen3_checkpoint_labelled_apertus_is_refused(tiny_checkpoint, tmp_path):
    d = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    (d / "config.json").write_text(json.dumps(preset("apertus-tiny").to_hf_dict()))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.0.attention_layernorm.weight' "
                                              r"\(and \d+ more\); is this a checkpoint of Apertus with 2 layers"):
        Checkpoint.open(d)


# ------------------------------------------------------------------------------------------- tokenizer, template

def test_tokenizer_has_apertus_special_tokens_at_their_ids(apertus_tiny_checkpoint):
    t = Checkpoint.open(apertus_tiny_checkpoint).tokenizer()
    assert t.get_vocab_size() == tok.VOCAB_SIZE == preset("apertus-tiny").vocab_size
    for token, i in {**tok.CHAT_TOKENS, "<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}.items():
        assert t.token_to_id(token) == i
        assert t.encode(token, add_special_tokens=False).ids == [i]
    text = "Grüezi <|inner_prefix|>hmm<|inner_suffix|>ok"
    ids = t.encode(text, add_special_tokens=False).ids
    assert ids.count(69) == ids.count(70) == 1 and t.decode(ids, skip_special_tokens=True) == text
    assert t.decode(t.encode("<|assistant_end|>x", add_special_tokens=False).ids, skip_special_tokens=True) == "x"


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<|inner_prefix|>greet back<|inner_suffix|>Hello!"},
    {"role": "user", "content": "Sum 2+2"},
]


def test_template_renders_apertus_format_and_drops_earlier_reasoning():
    text = render_chat(tok.CHAT_TEMPLATE, CONVERSATION)
    assert text == ("<s><|system_start|>Be brief.<|system_end|>"
                    "<|developer_start|>Deliberation: disabled\nTool Capabilities: disabled<|developer_end|>"
                    "<|user_start|>Hi<|user_end|><|assistant_start|>Hello!<|assistant_end|>"
                    "<|user_start|>Sum 2+2<|user_end|><|assistant_start|>")
    last = render_chat(tok.CHAT_TEMPLATE, CONVERSATION[:3], add_generation_prompt=False, enable_thinking=True)
    assert last.endswith("<|assistant_start|><|inner_prefix|>greet back<|inner_suffix|>Hello!<|assistant_end|>")
    assert "Deliberation: enabled" in last
    apart = [CONVERSATION[1], {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"}]
    assert render_chat(tok.CHAT_TEMPLATE, apart, add_generation_prompt=False).endswith(
        "<|system_start|>You are a helpful assistant.<|system_end|><|developer_start|>Deliberation: disabled\n"
        "Tool Capabilities: disabled<|developer_end|><|user_start|>Hi<|user_end|>"
        "<|assistant_start|><|inner_prefix|>2+2=4<|inner_suffix|>4<|assistant_end|>")
    developer = render_chat(tok.CHAT_TEMPLATE, [{"role": "developer", "content": "Rules."}, CONVERSATION[1]])
    assert "<|system_end|><|developer_start|>Rules.<|developer_end|><|user_start|>Hi" in developer
    with pytest.raises(ValueError, match="not tool"):
        render_chat(tok.CHAT_TEMPLATE, [CONVERSATION[1], {"role": "tool", "content": "4"}])


# ------------------------------------------------------------------------------------------- the engine on the CPU

@pytest.fixture(scope="module")
def reference(apertus_tiny_checkpoint) -> ReferenceModel:
    return ReferenceModel.from_checkpoint(Checkpoint.open(apertus_tiny_checkpoint))


def test_cpu_llm_greedy_equals_the_reference_across_pages(apertus_tiny_checkpoint, reference):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(73, 329, n).tolist() for n in (5, 40, 70)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM(apertus_tiny_checkpoint, device="cpu", progress=False, page_size=16, max_num_seqs=4,
             max_context=128, max_num_batched_tokens=48) as llm:   # 70 tokens prefill in two chunks
        outs = llm.generate(prompts, params)
        assert llm.eos_token_ids == {68}
    for prompt, out in zip(prompts, outs):
        assert len(prompt) + 20 > 16              # every sequence crosses a page boundary, the longest five
        assert out.token_ids == reference.greedy(prompt, 20)


def test_chat_session_on_apertus_tiny(apertus_tiny_checkpoint):
    with LLM(apertus_tiny_checkpoint, device="cpu", progress=False, max_num_seqs=2, max_context=512) as llm:
        chat = tileinfer.ChatSession(llm, max_context=512, system="Be brief.")
        chat.send("Hello there", max_tokens=6)
        first = chat.last_turn
        prompt = chat.render(chat.messages[:1] + [{"role": "user", "content": "Hello there"}])
        assert prompt[:2] == [1, 61] and prompt[-1] == 67    # <s><|system_start|> ... <|assistant_start|>
        assert first.reused_tokens == 0 and first.computed_tokens == first.prompt_tokens == len(prompt)
        chat.send("And again", max_tokens=6)
        second = chat.last_turn
        # the cache is reused past the first prompt, into the reply (a random byte-level reply need not
        # re-tokenize to its own tokens: a lone UTF-8 continuation byte decodes to U+FFFD)
        assert second.reused_tokens > first.prompt_tokens
        assert second.computed_tokens == second.prompt_tokens - second.reused_tokens
        assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
        assert not llm.has_unfinished_requests()


def test_generate_and_int8_logits_on_a_cpu_model(apertus_tiny_checkpoint, reference):
    model = tileinfer.load_model(apertus_tiny_checkpoint, device="cpu")
    prompt = [1, 65, 110, 120, 130, 66, 67]
    result = tileinfer.generate(model, prompt, max_new_tokens=4, stop_at_eos=False)
    assert result.token_ids == reference.greedy(prompt, 4)
    np.testing.assert_allclose(model.logits(prompt, chunk=3), reference.forward(prompt), rtol=1e-4, atol=1e-4)
    int8 = model.logits(prompt, kv_quantize="int8", chunk=3)
    np.testing.assert_allclose(int8, reference.forward(prompt, reference.new_cache(int8=True, smoothing=True)),
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- GPU weights

def test_device_xielu_parameters_are_the_references_gains(apertus_tiny_checkpoint, reference):
    """What the GPU's epilogue applies ([a_p, a_n, beta, eps], model/weights.py) is what the reference's
    xielu computes from the stored scalars: the kernels' formula with these four equals the reference's."""
    from tileinfer.model.checkpoint import Checkpoint
    from tileinfer.model.reference import xielu
    from tileinfer.model.weights import mlp_input_tensors, xielu_params
    ckpt = Checkpoint.open(apertus_tiny_checkpoint)
    for i, layer in enumerate(reference.layers):
        a_p, a_n, beta, eps = xielu_params(ckpt, f"model.layers.{i}.")
        m = layer.mlp
        assert (beta, eps) == (m.beta, m.eps)
        x = np.linspace(-30, 30, 2001, dtype=np.float32)
        kernel = np.where(x > 0, a_p * x * x + beta * x, (np.expm1(np.minimum(x, eps)) - x) * a_n + beta * x)
        np.testing.assert_allclose(kernel, xielu(x, m.alpha_p, m.alpha_n, m.beta, m.eps), rtol=1e-6, atol=1e-6)
    assert mlp_input_tensors(ckpt.config, "model.layers.0.") == ("model.layers.0.mlp.up_proj.weight",)


def test_bf16_checkpoint_values_are_what_the_reference_reads(apertus_tiny_checkpoint, reference):
    stored = SafetensorsFile(apertus_tiny_checkpoint / "model.safetensors").read("model.layers.0.mlp.act_fn.alpha_n")
    assert stored.dtype == ml_dtypes.bfloat16
    assert reference.layers[0].mlp.alpha_n == np.float32(stored.astype(np.float32)[0])


# ------------------------------------------------------------------------------------------- server

def test_the_server_answers_an_apertus_chat_as_generate_does(apertus_tiny_checkpoint):
    """tileinfer serve on an Apertus checkpoint: the chat is rendered with Apertus' template and the reply
    (greedy) is what LLM.generate gives for that rendering, ending at <|assistant_end|> or max_tokens."""
    from test_server import NAME, serving
    from tileinfer.chat import render_chat
    settings = dict(device="cpu", max_num_seqs=2, max_context=512, progress=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    server = serving(apertus_tiny_checkpoint, settings)
    s = next(server)
    try:
        r = s.client().chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    finally:
        next(server, None)
    with LLM(apertus_tiny_checkpoint, **settings) as llm:
        prompt = render_chat(llm.runner.checkpoint.chat_template, messages)
        assert prompt.startswith("<s><|system_start|>Be brief.<|system_end|>")
        want = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids)
