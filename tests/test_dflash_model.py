"""DFlash drafters below the engine: config.json and checkpoint layout (and every way they can be wrong), the
target's hidden-state capture, the float32 reference drafter against a naive float64 one, its cache that
keeps context only, the reference's DFlash loop, and the synthetic drafters of scripts/make_checkpoint.py."""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tileinfer.model.checkpoint import Checkpoint, CheckpointError, dflash_tensors
from tileinfer.model.config import ConfigError, Qwen3Config, preset, read_config
from tileinfer.model.dflash_config import DFLASH_PRESETS, DFlashConfig, is_dflash_dir, read_draft_config
from tileinfer.model.dflash_reference import DFlashReference, dflash_greedy
from tileinfer.model.reference import (ReferenceModel, apply_rope, attention, block_attention, rms_norm,
                                       rope_inv_freq)
from tileinfer.model.safetensors_io import SafetensorsFile, write_safetensors
from tileinfer.model.synthetic import write_checkpoint

REPO = Path(__file__).resolve().parents[1]

# A small target (three layers, so a middle one is read too) and a drafter of two layers reading two of them.
TARGET = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
DRAFT = DFlashConfig(decoder=dataclasses.replace(TARGET, num_hidden_layers=2, intermediate_size=40),
                     block_size=6, mask_token_id=95, target_layer_ids=(0, 2), num_target_layers=3)

# z-lab's Qwen3-8B-DFlash-b16 config.json, as published (the keys TileInfer reads and those it checks).
ZLAB_8B = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}, "dtype": "bfloat16",
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960,
    "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5,
    "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target ReferenceModel, bound DFlashReference) from synthetic checkpoints."""
    root = tmp_path_factory.mktemp("dflash-micro")
    write_checkpoint(TARGET, root / "target", seed=4, progress=False)
    write_checkpoint(DRAFT, root / "draft", seed=5, progress=False)
    target = ReferenceModel.from_checkpoint(Checkpoint.open(root / "target"))
    drafter = DFlashReference.from_checkpoint(Checkpoint.open_draft(root / "draft"))
    drafter.bind_target(target)
    return target, drafter


@pytest.fixture
def draft_dir(tmp_path):
    write_checkpoint(DRAFT, tmp_path / "draft", seed=5, progress=False)
    return tmp_path / "draft"


# ---------------------------------------------------------------------------- config.json

def test_z_labs_config_is_read():
    config = DFlashConfig.from_dict(ZLAB_8B)
    assert config == DFLASH_PRESETS["dflash-qwen3-8b"][1]
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))
    assert config.decoder.hidden_size == 4096 and config.num_hidden_layers == 5 and config.feature_size == 5 * 4096
    config.check_target(preset("qwen3-8b"))
    # Older drafters keep the ids and the mask at the top level.
    flat = {k: v for k, v in ZLAB_8B.items() if k != "dflash_config"} | {"mask_token_id": 151669,
                                                                        "target_layer_ids": [1, 9, 17, 25, 33]}
    assert DFlashConfig.from_dict(flat) == config


def test_the_4b_preset_has_its_published_parameter_count():
    _, config = DFLASH_PRESETS["dflash-qwen3-4b"]
    config.check_target(preset("qwen3-4b"))
    assert sum(math.prod(s) for s in dflash_tensors(config).values()) == 537_427_200


def _edited(change) -> dict:
    raw = copy.deepcopy(ZLAB_8B)
    change(raw)
    return raw


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("block_size"), "missing block_size"),
    (lambda r: r.update(block_size=1), "block_size must be an integer >= 2"),
    (lambda r: r["dflash_config"].pop("target_layer_ids"), "missing target_layer_ids"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[1, 1]), "names a layer twice"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[1, 40]), "reach past num_target_layers (36)"),
    (lambda r: r["dflash_config"].update(target_layer_ids=3), "target_layer_ids must be a list"),
    (lambda r: r["dflash_config"].update(mask_token_id=151936), "mask_token_id 151936 is outside the vocabulary"),
    (lambda r: r["dflash_config"].pop("mask_token_id"), "missing mask_token_id"),
    (lambda r: r.update(layer_types=["sliding_attention"] * 5), "not sliding-window ones"),
    (lambda r: r.update(is_causal=True), "is_causal=True is not supported"),
    (lambda r: r["dflash_config"].update(input_embedding_scale=2.0), "input_embedding_scale=2.0 is not supported"),
    (lambda r: r.update(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
    (lambda r: r.update(architectures=["DFlash2DraftModel"]), "DFlashDraftModel drafters only"),
    (lambda r: r.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda r: r.update(head_dim=100), "head_dim must be a multiple of 16"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ConfigError, match="my/config.json") as e:
        DFlashConfig.from_dict(_edited(change), source="my/config.json")
    assert message in str(e.value)


def test_a_drafter_must_fit_its_target():
    config = DFlashConfig.from_dict(ZLAB_8B)
    with pytest.raises(ValueError) as e:
        config.check_target(preset("qwen3-4b"))
    assert "hidden_size 4096 differs from the target's 2560" in str(e.value)
    with pytest.raises(ValueError, match="reach past the target's 2 layers"):
        DFLASH_PRESETS["dflash-qwen3-4b"][1].check_target(dataclasses.replace(preset("qwen3-4b"), num_hidden_layers=2))
    with pytest.raises(ValueError, match="made for a target of 36 layers, not 40"):
        config.check_target(dataclasses.replace(preset("qwen3-8b"), num_hidden_layers=40))
    with pytest.raises(ValueError, match="vocab_size 151936 differs from the target's 1000"):
        config.check_target(dataclasses.replace(preset("qwen3-8b"), vocab_size=1000))


def test_a_drafter_is_recognised_and_never_taken_for_a_model(draft_dir, tiny_checkpoint):
    assert is_dflash_dir(draft_dir) and not is_dflash_dir(tiny_checkpoint) and not is_dflash_dir(draft_dir / "nope")
    assert read_draft_config(draft_dir) == DRAFT and read_draft_config(tiny_checkpoint) == preset("tiny")
    with pytest.raises(ConfigError, match="a DFlash drafter .*pass its directory as draft_model"):
        read_config(draft_dir)
    with pytest.raises(CheckpointError, match="a DFlash drafter"):
        Checkpoint.open(draft_dir)


# ---------------------------------------------------------------------------- checkpoint layout

def test_the_checkpoint_holds_z_labs_tensor_names(draft_dir):
    ckpt = Checkpoint.open_draft(draft_dir)
    assert ckpt.config == DRAFT
    assert list(ckpt.tensors)[:2] == ["fc.weight", "hidden_norm.weight"] and list(ckpt.tensors)[-1] == "norm.weight"
    assert ckpt.tensors["fc.weight"].shape == (32, 2 * 32)
    assert "layers.1.self_attn.k_norm.weight" in ckpt.tensors and "layers.1.mlp.down_proj.weight" in ckpt.tensors
    assert not any(name.startswith(("model.", "lm_head", "embed")) for name in ckpt.tensors)
    assert json.loads((draft_dir / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert not (draft_dir / "tokenizer.json").exists()  # the target's tokenizer is the drafter's


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "missing tensor 'layers.1.mlp.up_proj.weight'; is this a "
                                                     "checkpoint of DFlash with 2 layers?"),
    (lambda t: t.update({"lm_head.weight": t["norm.weight"]}), "1 unexpected tensor(s), e.g. lm_head.weight"),
    (lambda t: t.update({"fc.weight": t["fc.weight"][:, :32]}), "tensor 'fc.weight' has shape [32, 32], but "
                                                                "config.json implies [32, 64]"),
])
def test_a_broken_checkpoint_is_named(draft_dir, edit, message):
    file = SafetensorsFile(draft_dir / "model.safetensors")
    tensors = {name: np.array(file.read(name)) for name in file.tensors}
    del file
    edit(tensors)
    write_safetensors(draft_dir / "model.safetensors", tensors)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open_draft(draft_dir)
    assert message in str(e.value)


# ---------------------------------------------------------------------------- the target's capture

def test_captured_states_are_each_layers_output_from_the_same_pass(models):
    target, _ = models
    tokens = [5, 17, 3, 88, 40, 2, 61]
    logits, features = target.forward_features(tokens, (2, 0, 1))
    np.testing.assert_array_equal(logits, target.forward(tokens))
    h = target.embed[tokens]
    outputs = []
    for layer in target.layers:  # the layers by hand, over the whole prompt
        x = rms_norm(h, layer.input_norm, TARGET.rms_norm_eps)
        q, k, v = (x @ w.T for w in (layer.q_proj, layer.k_proj, layer.v_proj))
        q = q.reshape(len(tokens), 4, 16)
        k, v = k.reshape(len(tokens), 2, 16), v.reshape(len(tokens), 2, 16)
        inv = rope_inv_freq(16, TARGET.rope_theta)
        pos = np.arange(len(tokens))
        q = apply_rope(rms_norm(q, layer.q_norm, TARGET.rms_norm_eps), pos, inv)
        k = apply_rope(rms_norm(k, layer.k_norm, TARGET.rms_norm_eps), pos, inv)
        h = h + attention(q, k, v, pos, pos).reshape(len(tokens), 64) @ layer.o_proj.T
        h = h + layer.mlp(rms_norm(h, layer.post_norm, TARGET.rms_norm_eps), lambda t: t)
        outputs.append(h)
    # transformers' hidden_states[3] (after the last layer) is the final-normed state
    want = np.concatenate([rms_norm(outputs[2], target.norm, TARGET.rms_norm_eps), outputs[0], outputs[1]], axis=1)
    np.testing.assert_allclose(features, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="distinct layers in 0..2"):
        target.forward_features(tokens, (0, 3))


# ---------------------------------------------------------------------------- the drafter

def naive_draft_logits(drafter: DFlashReference, contexts, block, start) -> np.ndarray:
    """One draft forward in float64 with explicit loops: contexts is a list of (features, positions), earlier
    ones first (all of them context keys); returns the logits of block rows 1.."""
    c, d = drafter.config, drafter.config.decoder
    eps, f64 = d.rms_norm_eps, (lambda a: np.asarray(a, np.float64))
    norm = lambda x, w: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(w)  # noqa: E731
    inv = f64(rope_inv_freq(d.head_dim, d.rope_theta))

    def rope(x, p):  # x [heads, hd] at position p
        half = d.head_dim // 2
        angle = np.concatenate([p * inv, p * inv])
        return x * np.cos(angle) + np.concatenate([-x[:, half:], x[:, :half]], axis=1) * np.sin(angle)

    features = np.concatenate([f for f, _ in contexts])
    ctx_pos = np.concatenate([p for _, p in contexts])
    ctx = norm(f64(features) @ f64(drafter.fc).T, drafter.hidden_norm)
    block_pos = start + np.arange(len(block))
    h = f64(drafter.embed)[block]
    group = d.num_attention_heads // d.num_key_value_heads
    for layer in drafter.layers:
        x = norm(h, layer.input_norm)
        both, pos = np.concatenate([ctx, x]), np.concatenate([ctx_pos, block_pos])
        keys = [rope(norm((r @ f64(layer.k_proj).T).reshape(-1, d.head_dim), layer.k_norm), p)
                for r, p in zip(both, pos)]
        values = [(r @ f64(layer.v_proj).T).reshape(-1, d.head_dim) for r in both]
        out = np.zeros((len(block), d.num_attention_heads, d.head_dim))
        for i, row in enumerate(x):
            q = rope(norm((row @ f64(layer.q_proj).T).reshape(-1, d.head_dim), layer.q_norm), block_pos[i])
            for head in range(d.num_attention_heads):
                kv = head // group
                scores = np.array([q[head] @ key[kv] for key in keys]) / math.sqrt(d.head_dim)
                p = np.exp(scores - scores.max())
                out[i, head] = (p / p.sum()) @ np.array([v[kv] for v in values])
        h = h + out.reshape(len(block), -1) @ f64(layer.o_proj).T
        y = norm(h, layer.post_norm)
        gate, up = y @ f64(layer.mlp.gate_proj).T, y @ f64(layer.mlp.up_proj).T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ f64(layer.mlp.down_proj).T
    assert c.block_size >= len(block)
    return norm(h[1:], drafter.norm) @ f64(drafter.lm_head).T


def test_block_attention_reads_every_key():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 4, 16)), rng.standard_normal((5, 2, 16)), rng.standard_normal((5, 2, 16))
    q, k, v = (a.astype(np.float32) for a in (q, k, v))
    everything = block_attention(q, k, v)
    # The same as causal attention whose queries all sit after every key; not as queries at their own positions.
    np.testing.assert_allclose(everything, attention(q, k, v, np.full(3, 10), np.arange(5)), rtol=1e-6)
    assert not np.allclose(everything, attention(q, k, v, np.arange(2, 5), np.arange(5)))
    changed = v.copy()
    changed[-1] += 1.0  # the last key's value moves the first query's output: nothing is masked
    assert not np.allclose(block_attention(q, k, changed)[0], everything[0])


def test_a_draft_forward_matches_a_naive_float64_drafter(models):
    target, drafter = models
    rng = np.random.default_rng(1)
    first = rng.standard_normal((9, DRAFT.feature_size)).astype(np.float32) * 3
    second = rng.standard_normal((3, DRAFT.feature_size)).astype(np.float32) * 3
    cache = drafter.new_cache()
    drafter.draft(first, np.arange(9), 7, 2, 9, cache)  # the first context is cached by an earlier round
    assert len(cache) == 9
    block = drafter.block(41, 5)  # the last committed token and 5 masks at positions 12..17
    entry = cache.append_positions(np.concatenate([np.arange(9, 12), 12 + np.arange(6)]))
    logits = drafter.forward(second, np.arange(9, 12), block, 12, cache, entry)
    assert logits.shape == (5, TARGET.vocab_size)  # rows 1..5: the tokens at positions 13..17
    want = naive_draft_logits(drafter, [(first, np.arange(9)), (second, np.arange(9, 12))], block, 12)
    np.testing.assert_allclose(logits, want, rtol=2e-4, atol=2e-4)


def test_the_cache_keeps_the_context_and_drops_the_block(models):
    _, drafter = models
    rng = np.random.default_rng(2)
    features = rng.standard_normal((6, DRAFT.feature_size)).astype(np.float32)
    cache = drafter.new_cache()
    drafts = drafter.draft(features[:4], np.arange(4), 9, 5, 4, cache)
    assert len(drafts) == 5 and len(cache) == 4  # the block's six entries are gone again
    alone = drafter.new_cache()
    drafter.draft(features[:4], np.arange(4), 30, 1, 4, alone)  # other block, other k: the same context entries
    for layer in range(DRAFT.num_hidden_layers):
        np.testing.assert_array_equal(cache.keys[layer], alone.keys[layer])
        np.testing.assert_array_equal(cache.values[layer], alone.values[layer])
    # A later round over the cached context and two new positions equals one round over all six at once.
    later = drafter.draft(features[4:], np.arange(4, 6), 9, 5, 6, cache)
    assert len(cache) == 6 and later == drafter.draft(features, np.arange(6), 9, 5, 6, drafter.new_cache())
    # The drafts are the argmax of block rows 1..k, not of rows 0..k-1.
    logits = naive_draft_logits(drafter, [(features, np.arange(6))], drafter.block(9, 5), 6)
    assert later == [int(t) for t in logits.argmax(axis=1)]


def test_the_reference_dflash_loop_gives_plain_greedy(models):
    target, drafter = models
    for prompt in ([3, 1, 4, 1, 5, 9, 2], [60]):
        tokens, lengths = dflash_greedy(target, drafter, prompt, 17)
        assert tokens == target.greedy(prompt, 17)
        assert sum(lengths) == 16 and all(1 <= n <= DRAFT.block_size for n in lengths)


def test_an_unbound_drafter_says_what_it_needs():
    weights = {name: np.zeros(shape, np.float32) for name, shape in dflash_tensors(DRAFT).items()}
    drafter = DFlashReference(DRAFT, weights)
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.draft(np.zeros((1, DRAFT.feature_size), np.float32), [0], 1, 2, 1, drafter.new_cache())
    del weights["layers.0.self_attn.o_proj.weight"]
    with pytest.raises(ValueError, match="lack 'layers.0.self_attn.o_proj.weight'"):
        DFlashReference(DRAFT, weights)


# ---------------------------------------------------------------------------- synthetic drafters

def make_checkpoint_main():
    """scripts/make_checkpoint.py's main, imported from its file."""
    spec = importlib.util.spec_from_file_location("make_checkpoint", REPO / "scripts" / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_make_checkpoint_writes_a_dflash_preset_for_its_target(tmp_path, tiny_checkpoint, capsys):
    main = make_checkpoint_main()
    assert main(["--preset", "dflash-tiny", "--target", str(tiny_checkpoint), "--out", str(tmp_path / "d")]) == 0
    ckpt = Checkpoint.open_draft(tmp_path / "d")
    assert ckpt.config == DFLASH_PRESETS["dflash-tiny"][1] and ckpt.config.target_layer_ids == (0, 1)
    ckpt.config.check_target(preset("tiny"))
    with pytest.raises(SystemExit):
        main(["--preset", "dflash-tiny", "--out", str(tmp_path / "e")])
    assert "give its checkpoint directory as --target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--preset", "dflash-qwen3-8b", "--target", str(tiny_checkpoint), "--out", str(tmp_path / "e")])
    assert "hidden_size 4096 differs from the target's 128" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_a_synthetic_drafters_logits_are_spread_like_its_targets(models):
    _, drafter = models
    features = np.random.default_rng(3).standard_normal((5, DRAFT.feature_size)).astype(np.float32)
    cache = drafter.new_cache()
    entry = cache.append_positions(np.arange(11))
    logits = drafter.forward(features, np.arange(5), drafter.block(1, 5), 5, cache, entry)
    assert np.all(np.isfinite(logits)) and 3.0 < logits.std() < 8.0  # TARGET_LOGIT_STD is 5
