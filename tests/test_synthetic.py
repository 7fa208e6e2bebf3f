"""Synthetic checkpoints: layout, determinism, weight statistics, peaked logits; the chat template."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tileinfer.model import synthetic
from tileinfer.model.checkpoint import Checkpoint, expected_tensors
from tileinfer.model.config import Qwen3Config, preset
from tileinfer.model.safetensors_io import SafetensorsFile
from tileinfer.model.tokenizer import ADDED_TOKENS, CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[1]
MICRO = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


# ---------------------------------------------------------------------------------------------- layout

def test_tiny_preset_writes_the_hugging_face_layout(tiny_checkpoint):
    names = sorted(p.name for p in tiny_checkpoint.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert Qwen3Config.from_json(tiny_checkpoint) == preset("tiny")
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True

    generation = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                          "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}

    tokenizer_config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and tokenizer_config["pad_token"] == "<|endoftext|>"
    assert tokenizer_config["bos_token"] is None and tokenizer_config["tokenizer_class"] == "Qwen2Tokenizer"
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["model_max_length"] == preset("tiny").max_position_embeddings
    decoder = tokenizer_config["added_tokens_decoder"]
    assert [decoder[str(151643 + i)]["content"] for i in range(26)] == list(ADDED_TOKENS)

    weights = SafetensorsFile(tiny_checkpoint / "model.safetensors")
    assert weights.metadata == {"format": "pt"}
    assert list(weights.tensors) == list(expected_tensors(preset("tiny")))
    assert {info.dtype for info in weights.tensors.values()} == {"BF16"}
    assert "lm_head.weight" not in weights.tensors            # tied: transformers ties it itself


def test_untied_config_writes_lm_head(tmp_path):
    synthetic.write_checkpoint(MICRO, tmp_path, progress=False)
    assert "lm_head.weight" in SafetensorsFile(tmp_path / "model.safetensors").tensors


def test_same_seed_same_bytes_whatever_the_thread_count(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "CHUNK_ELEMENTS", 1000)     # several chunks per tensor
    for name, seed, workers in (("a", 5, 1), ("b", 5, 4), ("c", 6, 4)):
        synthetic.write_checkpoint(MICRO, tmp_path / name, seed=seed, workers=workers, progress=False)
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"]
    assert weights["a"] != weights["c"]


def test_sharding_names_and_index(tmp_path):
    synthetic.write_checkpoint(MICRO, tmp_path, max_shard_bytes=20_000, progress=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    sizes = [(tmp_path / s).stat().st_size for s in shards]
    assert index["metadata"]["total_size"] == sum(np.prod(s) for s in expected_tensors(MICRO).values()) * 2
    assert max(sizes) < 20_000 + 4096                          # data within the limit, plus the header
    # Rewriting as one file removes the stale shards and index.
    synthetic.write_checkpoint(MICRO, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_plan_shards_puts_an_oversized_tensor_alone():
    shapes = {"a": (10,), "b": (100,), "c": (10,), "d": (10,)}
    assert synthetic.plan_shards(shapes, max_shard_bytes=50) == [["a"], ["b"], ["c", "d"]]


def test_cli_writes_a_checkpoint(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "make_checkpoint.py"), "--preset", "tiny",
                             "--out", str(tmp_path / "cli"), "--seed", "2"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "GB/s" in result.stdout
    assert Checkpoint.open(tmp_path / "cli").config == preset("tiny")


# ---------------------------------------------------------------------------------------------- statistics

def as_f32(ckpt: Checkpoint, name: str) -> np.ndarray:
    return ckpt.read(name).astype(np.float32)


def test_weights_look_like_a_trained_models(tiny_checkpoint):
    ckpt = Checkpoint.open(tiny_checkpoint)
    config = ckpt.config
    assert as_f32(ckpt, "model.embed_tokens.weight").std() == pytest.approx(0.02, rel=0.02)
    assert as_f32(ckpt, "model.layers.1.mlp.gate_proj.weight").std() == pytest.approx(0.02, rel=0.02)
    shrunk = 0.02 / np.sqrt(2 * config.num_hidden_layers)
    assert as_f32(ckpt, "model.layers.1.mlp.down_proj.weight").std() == pytest.approx(shrunk, rel=0.02)
    norm = as_f32(ckpt, "model.layers.1.input_layernorm.weight")
    assert norm.mean() == pytest.approx(1, abs=0.02) and 0.03 < norm.std() < 0.07
    final = as_f32(ckpt, "model.norm.weight")
    assert final.mean() == pytest.approx(synthetic.final_norm_scale(config.hidden_size), rel=0.02)

    # Layer 0's k_norm: three rotary pairs (i, i + head_dim/2) about 100x the rest; later layers none.
    k_norm = as_f32(ckpt, "model.layers.0.self_attn.k_norm.weight")
    big = np.flatnonzero(k_norm > 50)
    half = config.head_dim // 2
    assert len(big) == 6 and set(big[3:] - half) == set(big[:3])
    assert np.all(k_norm[big] / np.median(k_norm) > 70)
    assert as_f32(ckpt, "model.layers.1.self_attn.k_norm.weight").max() < 2
    # ...matched by query channels 100x smaller, so the attention scores stay moderate.
    q_norm = as_f32(ckpt, "model.layers.0.self_attn.q_norm.weight")
    assert np.all(q_norm[big] < 0.02) and np.flatnonzero(q_norm < 0.5).tolist() == big.tolist()


def forward_logits(ckpt: Checkpoint, ids: np.ndarray) -> np.ndarray:
    """A minimal float32 Qwen3 forward over one sequence (our own, independent of the engine)."""
    c = ckpt.config
    T, hd, H, KV = len(ids), c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def w(name):
        return as_f32(ckpt, name)

    def norm(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * weight

    angles = np.arange(T)[:, None] / c.rope_theta ** (np.arange(0, hd, 2) / hd)
    cos, sin = (np.tile(f(angles), 2)[:, None, :] for f in (np.cos, np.sin))      # [T, 1, hd]

    def rope(x):                                                                    # [T, heads, hd]
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1) * sin

    embed = w("model.embed_tokens.weight")
    h = embed[ids]                                                                  # [T, D]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = norm(h, w(p + "input_layernorm.weight"))
        q = rope(norm((x @ w(p + "self_attn.q_proj.weight").T).reshape(T, H, hd), w(p + "self_attn.q_norm.weight")))
        k = rope(norm((x @ w(p + "self_attn.k_proj.weight").T).reshape(T, KV, hd), w(p + "self_attn.k_norm.weight")))
        v = (x @ w(p + "self_attn.v_proj.weight").T).reshape(T, KV, hd)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        h = h + np.einsum("hts,shd->thd", probs, v).reshape(T, H * hd) @ w(p + "self_attn.o_proj.weight").T
        x = norm(h, w(p + "post_attention_layernorm.weight"))
        gate, up = x @ w(p + "mlp.gate_proj.weight").T, x @ w(p + "mlp.up_proj.weight").T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w(p + "mlp.down_proj.weight").T
    head = embed if c.tie_word_embeddings else w("lm_head.weight")
    return norm(h, w("model.norm.weight")) @ head.T                                # [T, V]


def test_next_token_distributions_are_peaked_like_a_trained_models(tiny_checkpoint):
    ckpt = Checkpoint.open(tiny_checkpoint)
    ids = np.random.default_rng(0).integers(0, 151643, size=48)
    logits = forward_logits(ckpt, ids)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top1 = probs.max(-1)
    print(f"logit std {logits.std(-1).mean():.2f}, mean top-1 probability {top1.mean():.3f}")
    assert logits.std(-1).mean() == pytest.approx(synthetic.TARGET_LOGIT_STD, rel=0.1)
    assert 0.2 <= top1.mean() <= 0.9


# ---------------------------------------------------------------------------------------------- chat template

@pytest.fixture(params=[False, True], ids=["plain", "hf-trim"])
def render(request):
    # Hugging Face renders with trim_blocks and lstrip_blocks; the template must not depend on them.
    env = ImmutableSandboxedEnvironment(trim_blocks=request.param, lstrip_blocks=request.param)
    template = env.from_string(CHAT_TEMPLATE)
    return lambda messages, **kwargs: template.render(messages=messages, **kwargs)


def test_two_turns_drop_earlier_reasoning(render):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ]
    assert render(messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_reasoning_after_the_last_user_message_is_kept(render):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"}]
    assert render(messages) == ("<|im_start|>user\nhi<|im_end|>\n"
                                "<|im_start|>assistant\n<think>\ngreet\n</think>\n\nHello!<|im_end|>\n")


def test_enable_thinking_false_adds_an_empty_think_block(render):
    messages = [{"role": "user", "content": "hi"}]
    assert render(messages, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(messages, add_generation_prompt=True, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert render(messages, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


# ---------------------------------------------------------------------------- load_format="dummy"
def test_dummy_load_format_makes_the_written_weights_from_config_alone(tmp_path, tiny_checkpoint):
    """A --config-only directory (no weight file) with load_format="dummy" reads exactly the tensors the
    synthetic checkpoint of seed 0 holds, and an LLM over it answers as one over that checkpoint."""
    from tileinfer import LLM, SamplingParams
    from tileinfer.model.checkpoint import CheckpointError, DummyCheckpoint, load_checkpoint
    out = tmp_path / "tiny-config"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "make_checkpoint.py"), "--preset", "tiny", "--config-only",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not list(out.glob("*.safetensors*"))
    with pytest.raises(CheckpointError):
        load_checkpoint(out)  # "auto" needs the weight files
    dummy, written = load_checkpoint(out, "dummy"), Checkpoint.open(tiny_checkpoint)
    assert isinstance(dummy, DummyCheckpoint) and dummy.total_bytes == written.total_bytes
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_norm.weight", "model.layers.1.mlp.down_proj.weight"):
        assert np.array_equal(dummy.read(name).view(np.uint16), written.read(name).view(np.uint16)), name
    params = SamplingParams(max_tokens=8, temperature=0)
    with LLM(out, device="cpu", load_format="dummy", max_num_seqs=2, progress=False) as llm:
        got = llm.generate(["The weights of this model"], params)[0].token_ids
    with LLM(tiny_checkpoint, device="cpu", max_num_seqs=2, progress=False) as llm:
        assert got == llm.generate(["The weights of this model"], params)[0].token_ids
    with pytest.raises(ValueError, match="load_format must be"):
        LLM(out, device="cpu", load_format="random")


def test_a_tensors_rows_are_the_whole_tensors_rows_whatever_the_threads(monkeypatch):
    # load_format="dummy" makes a tensor-parallel rank's rows only (the chunks that hold them, on threads): the
    # same values as the whole tensor's rows, across chunk boundaries, with one thread or several.
    monkeypatch.setattr(synthetic, "CHUNK_ELEMENTS", 1000)
    name, shape = "model.layers.1.mlp.gate_proj.weight", (96, 64)  # 6,144 elements: 7 chunks
    whole = synthetic.synthetic_tensor(MICRO, 3, name, shape, workers=1)
    np.testing.assert_array_equal(whole, synthetic.synthetic_tensor(MICRO, 3, name, shape, workers=4))
    for rows in [(0, 96), (0, 15), (15, 16), (31, 47), (47, 96), (95, 96), (40, 40)]:
        part = synthetic.synthetic_tensor(MICRO, 3, name, shape, rows=rows, workers=3)
        assert part.shape == (rows[1] - rows[0], 64)
        np.testing.assert_array_equal(part, whole[rows[0]:rows[1]])
    with pytest.raises(ValueError, match="rows"):
        synthetic.synthetic_tensor(MICRO, 3, name, shape, rows=(90, 97))


def test_time_dummy_weights_makes_a_ranks_weights_and_says_how_fast():
    # scripts/time_dummy_weights.py: what load_format="dummy" costs a rank's start-up on the host's cores.
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "scripts" / "time_dummy_weights.py"
    done = subprocess.run([sys.executable, str(script), "--preset", "tiny", "--world", "2", "--rank", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tiny, rank 1 of 2: ") and "GB of dummy bf16 weights made in" in done.stdout
