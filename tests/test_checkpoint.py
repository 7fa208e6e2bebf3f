"""Opening Hugging Face checkpoint directories, and every way one can be wrong."""
from __future__ import annotations

import dataclasses
import json
import logging

import ml_dtypes
import numpy as np
import pytest

from tileinfer.model.checkpoint import Checkpoint, CheckpointError, expected_tensors
from tileinfer.model.config import Qwen3Config, preset
from tileinfer.model.safetensors_io import SafetensorsFile, write_safetensors
from tileinfer.model.synthetic import write_checkpoint
from tileinfer.model.tokenizer import CHAT_TEMPLATE

# Small enough to rewrite in every test; shapes deliberately all different.
MICRO = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


@pytest.fixture
def micro(tmp_path):
    out = tmp_path / "micro"
    write_checkpoint(MICRO, out, seed=3, progress=False)
    return out


def rewrite_weights(directory, change):
    """Load model.safetensors as arrays, let `change(dict)` edit them, write them back."""
    file = SafetensorsFile(directory / "model.safetensors")
    tensors = {name: np.array(file.read(name)) for name in file.tensors}
    del file
    change(tensors)
    write_safetensors(directory / "model.safetensors", tensors)


def edit_json(path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def test_tiny_checkpoint_opens(tiny_checkpoint):
    ckpt = Checkpoint.open(tiny_checkpoint)
    config = preset("tiny")
    assert ckpt.config == config and ckpt.path == tiny_checkpoint
    assert list(ckpt.tensors) == list(expected_tensors(config))
    assert "lm_head.weight" not in ckpt.tensors
    assert ckpt.eos_token_ids == [151645, 151643]
    assert ckpt.chat_template == CHAT_TEMPLATE
    embed = ckpt.read("model.embed_tokens.weight")
    assert embed.dtype == ml_dtypes.bfloat16 and embed.shape == (config.vocab_size, config.hidden_size)
    assert ckpt.total_bytes == sum(np.prod(s) for s in expected_tensors(config).values()) * 2
    assert ckpt.tokenizer().encode("Hello").ids == [9707]
    info = ckpt.tensors["model.norm.weight"]
    assert info.path == tiny_checkpoint / "model.safetensors" and info.dtype == "BF16"


def test_sharded_checkpoint_opens_and_matches_the_single_file(tmp_path, micro):
    sharded = tmp_path / "sharded"
    write_checkpoint(MICRO, sharded, seed=3, max_shard_bytes=8_000, progress=False)
    assert not (sharded / "model.safetensors").exists()
    single, split = Checkpoint.open(micro), Checkpoint.open(sharded)
    assert len({info.path for info in split.tensors.values()}) > 2
    for name in single.tensors:
        np.testing.assert_array_equal(split.read(name).view(np.uint16), single.read(name).view(np.uint16))


def test_missing_tensor_is_named(micro):
    rewrite_weights(micro, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'") as caught:
        Checkpoint.open(micro)
    assert str(micro) in str(caught.value)


def test_misshaped_tensor_names_file_and_both_shapes(micro):
    wrong = np.zeros((16, 32), ml_dtypes.bfloat16)
    rewrite_weights(micro, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": wrong}))
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(micro)
    message = str(caught.value)
    assert "'model.layers.0.self_attn.k_proj.weight'" in message and "model.safetensors" in message
    assert "[16, 32]" in message and "[32, 32]" in message


def test_unexpected_tensors_are_listed(micro):
    def add(t):
        for i in range(7):
            t[f"model.layers.0.extra_{i}.weight"] = np.zeros(2, ml_dtypes.bfloat16)
    rewrite_weights(micro, add)
    with pytest.raises(CheckpointError, match="7 unexpected tensor") as caught:
        Checkpoint.open(micro)
    message = str(caught.value)
    assert "extra_0" in message and "extra_4" in message and "extra_5" not in message   # at most 5 listed


def test_tied_checkpoint_ignores_a_stored_lm_head(tmp_path):
    write_checkpoint(dataclasses.replace(MICRO, tie_word_embeddings=True), tmp_path, progress=False)
    rewrite_weights(tmp_path, lambda t: t.update({"lm_head.weight": np.zeros((96, 32), ml_dtypes.bfloat16)}))
    assert "lm_head.weight" not in Checkpoint.open(tmp_path).tensors


def test_untied_checkpoint_needs_lm_head(micro):
    rewrite_weights(micro, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        Checkpoint.open(micro)


def test_missing_config(micro):
    (micro / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: no such file"):
        Checkpoint.open(micro)


def test_bad_config_json(micro):
    (micro / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        Checkpoint.open(micro)


def test_unsupported_model_type(micro):
    edit_json(micro / "config.json", lambda c: c.update(model_type="llama"))
    with pytest.raises(CheckpointError, match="model_type is 'llama'"):
        Checkpoint.open(micro)


@pytest.mark.parametrize("value", ["false", 0, None])
def test_tie_word_embeddings_must_be_a_boolean(micro, value):
    # bool("false") is True: a string read as a truth value would tie the LM head and ignore lm_head.weight
    edit_json(micro / "config.json", lambda c: c.update(tie_word_embeddings=value))
    with pytest.raises(CheckpointError, match=f"tie_word_embeddings must be true or false, got {value!r}"):
        Checkpoint.open(micro)


def test_not_a_directory_and_no_weights(tmp_path, micro):
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpoint.open(tmp_path / "nope")
    (micro / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights: expected model.safetensors or model.safetensors.index.json"):
        Checkpoint.open(micro)


def test_corrupt_weights_file(micro):
    (micro / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError, match="model.safetensors: header length 16 runs past the end"):
        Checkpoint.open(micro)


@pytest.fixture
def sharded(tmp_path):
    out = tmp_path / "sharded"
    write_checkpoint(MICRO, out, seed=1, max_shard_bytes=8_000, progress=False)
    return out


def shard_names(directory) -> list[str]:
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    return sorted(set(weight_map.values()))


def test_shard_listed_but_missing(sharded):
    second = shard_names(sharded)[1]
    (sharded / second).unlink()
    with pytest.raises(CheckpointError, match=f"lists shard '{second}', which is missing"):
        Checkpoint.open(sharded)


def test_tensor_not_in_the_shard_the_index_names(sharded):
    first = shard_names(sharded)[0]
    edit_json(sharded / "model.safetensors.index.json",
              lambda i: i["weight_map"].update({"model.norm.weight": first}))
    with pytest.raises(CheckpointError, match=f"tensor 'model.norm.weight' is in {first}, but it is not there"):
        Checkpoint.open(sharded)


def test_bad_index(sharded):
    index = sharded / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(CheckpointError, match="index.json: not valid JSON"):
        Checkpoint.open(sharded)
    index.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        Checkpoint.open(sharded)
    index.write_text('{"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}')
    with pytest.raises(CheckpointError, match="must be a file name inside the checkpoint directory"):
        Checkpoint.open(sharded)


def test_f32_weights_are_rounded_to_bf16_nearest_even(micro, caplog):
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: nearest even is 1.
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: nearest even is 1 + 2^-6.
    special = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5], np.float32)

    def to_f32(t):
        for name in t:
            t[name] = t[name].astype(np.float32)
        t["model.norm.weight"][:4] = special
    rewrite_weights(micro, to_f32)
    ckpt = Checkpoint.open(micro)
    assert ckpt.tensors["model.norm.weight"].dtype == "F32"
    with caplog.at_level(logging.INFO, logger="tileinfer.model.checkpoint"):
        norm = ckpt.read("model.norm.weight")
        ckpt.read("model.embed_tokens.weight")
    assert norm.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(norm[:4].astype(np.float32), [1.0, 1 + 2**-6, 1 + 2**-7, -2.5])
    assert sum("converting F32 weights to bfloat16" in r.getMessage() for r in caplog.records) == 1


def test_non_float_weights_are_rejected(micro):
    rewrite_weights(micro, lambda t: t.update({"model.norm.weight": np.zeros(32, np.int8)}))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype I8"):
        Checkpoint.open(micro)


def test_eos_ids_fall_back_to_config(micro):
    (micro / "generation_config.json").unlink()
    assert Checkpoint.open(micro).eos_token_ids == [151645]
    edit_json(micro / "config.json", lambda c: c.update(eos_token_id=[7, 8]))
    assert Checkpoint.open(micro).eos_token_ids == [7, 8]
    (micro / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(CheckpointError, match="eos_token_id must be a token id"):
        Checkpoint.open(micro)


def test_tokenizer_and_template_files_are_optional_until_used(micro):
    (micro / "tokenizer.json").unlink()
    (micro / "tokenizer_config.json").unlink()
    ckpt = Checkpoint.open(micro)
    assert ckpt.chat_template is None
    with pytest.raises(CheckpointError, match="tokenizer.json: no such file"):
        ckpt.tokenizer()
    (micro / "chat_template.jinja").write_text("{{ messages }}")
    assert Checkpoint.open(micro).chat_template == "{{ messages }}"


def test_unknown_tensor_name(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="no tensor named 'lm_head.weight'"):
        Checkpoint.open(tiny_checkpoint).read("lm_head.weight")

