"""A tensor-parallel rank's view of a checkpoint and its GPU plumbing, on the CPU (model/sharding.py
ShardedCheckpoint and TensorParallel; the embedding launchers' vocabulary offset; cuda/memory.py copy_columns'
checks). Each rank of 1, 2 and 4 reads its shards of a small synthetic checkpoint, tied and untied: its
local shapes, the embedding and LM head zero-padded past its vocabulary range to one width on every rank,
the ranks' real rows together the whole table. The GPU side is tests/gpu/test_tensor_parallel.py."""
from __future__ import annotations

import dataclasses
import importlib
import math
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from tileinfer.cuda import DeviceArray
from tileinfer.cuda.memory import copy_columns
from tileinfer.model.checkpoint import Checkpoint, expected_tensors
from tileinfer.model.config import ConfigError, Qwen3Config
from tileinfer.model.sharding import (ShardedCheckpoint, TensorParallel, local_config, shard_tensor, vocab_part,
                                      vocab_range)
from tileinfer.model.synthetic import write_checkpoint

# The launcher module (tileinfer.kernels exports its function under the same name).
embedding_module = importlib.import_module("tileinfer.kernels.embedding")

# 8 query heads, 4 KV heads (split 1, 2 or 4 ways); a vocabulary of 1003: no split of it is a multiple of 8, so
# every rank's table is padded (the last rank's the most: its range is short).
SMALL = Qwen3Config(vocab_size=1003, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False)
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def small_checkpoint(request, tmp_path_factory) -> Checkpoint:
    config = dataclasses.replace(SMALL, tie_word_embeddings=request.param)
    out = tmp_path_factory.mktemp("small-tp")
    write_checkpoint(config, out, seed=5, progress=False)
    return Checkpoint.open(out)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_reads_its_shards_with_the_vocabulary_padded(small_checkpoint, world):
    ckpt, config = small_checkpoint, small_checkpoint.config
    per = vocab_part(config.vocab_size, world)
    assert per % 8 == 0 and per >= -(-config.vocab_size // world)
    for name in VOCAB if not config.tie_word_embeddings else VOCAB[:1]:
        whole = ckpt.read(name)
        rows = []
        for rank in range(world):
            view = ShardedCheckpoint(ckpt, rank, world)
            start, stop = vocab_range(config.vocab_size, rank, world)
            table = view.read(name)
            assert table.shape == (per, config.hidden_size) and table.dtype == whole.dtype
            np.testing.assert_array_equal(table[:stop - start], whole[start:stop])
            assert not np.any(table[stop - start:].astype(np.float32)), f"rank {rank}: padding rows not zero"
            rows.append(table[:stop - start])
        np.testing.assert_array_equal(np.concatenate(rows), whole)  # the real rows cover the vocabulary once


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_of_dummy_weights_reads_what_a_rank_of_the_written_checkpoint_reads(small_checkpoint, world, tmp_path):
    # load_format="dummy" (the generator's weights for seed 0, made as read; a rank makes only the rows it holds)
    # against the same weights written to disk: every rank's every tensor the same.
    from tileinfer.model.checkpoint import DummyCheckpoint
    from tileinfer.model.synthetic import write_text_files
    config = small_checkpoint.config
    written = tmp_path / "written"
    write_checkpoint(config, written, seed=DummyCheckpoint.SEED, progress=False)
    (tmp_path / "dummy").mkdir()
    write_text_files(config, tmp_path / "dummy")
    disk, dummy = Checkpoint.open(written), DummyCheckpoint.open(tmp_path / "dummy")
    for rank in range(world):
        a, b = ShardedCheckpoint(disk, rank, world), ShardedCheckpoint(dummy, rank, world)
        for name in expected_tensors(config):
            np.testing.assert_array_equal(a.read(name), b.read(name), err_msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_holds_its_local_shapes_and_bytes(small_checkpoint, world):
    ckpt, config = small_checkpoint, small_checkpoint.config
    for rank in range(world):
        view = ShardedCheckpoint(ckpt, rank, world)
        local = view.config
        assert local == dataclasses.replace(local_config(config, rank, world),
                                            vocab_size=vocab_part(config.vocab_size, world))
        assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == \
            (8 // world, 4 // world, 128 // world)
        shapes = expected_tensors(local)
        assert ("lm_head.weight" in shapes) == (not config.tie_word_embeddings)
        assert {name: view.read(name).shape for name in shapes} == shapes
        assert view.total_bytes == 2 * sum(math.prod(s) for s in shapes.values())
        for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight",
                     "model.layers.0.input_layernorm.weight"):
            np.testing.assert_array_equal(view.read(name), shard_tensor(config, name, ckpt.read(name), rank, world))
        if world == 1:
            np.testing.assert_array_equal(view.read("model.layers.0.mlp.down_proj.weight"),
                                          ckpt.read("model.layers.0.mlp.down_proj.weight"))


def test_the_view_passes_the_checkpoint_through(small_checkpoint):
    view = ShardedCheckpoint(small_checkpoint, 1, 2)
    assert view.path == small_checkpoint.path and view.full_config == small_checkpoint.config
    assert view.eos_token_ids == small_checkpoint.eos_token_ids
    assert view.chat_template == small_checkpoint.chat_template
    assert view.tokenizer().encode("Hello").ids == small_checkpoint.tokenizer().encode("Hello").ids


def test_a_split_the_model_cannot_take_is_refused(small_checkpoint):
    with pytest.raises(ConfigError, match="does not divide the model's 4 KV heads"):
        ShardedCheckpoint(small_checkpoint, 0, 3)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        ShardedCheckpoint(small_checkpoint, 2, 2)


def comm(rank: int, world: int):
    """What TensorParallel reads of a Communicator (nccl4py is not needed to describe a rank)."""
    return SimpleNamespace(rank=rank, world_size=world)


def test_tensor_parallel_describes_a_ranks_vocabulary():
    tp = TensorParallel(comm(2, 4), 2, 4, 1003)
    assert (tp.vocab_start, tp.vocab_per) == (502, 256)
    assert tp.vocab_ranges() == [(0, 251), (251, 502), (502, 753), (753, 1003)]
    one = TensorParallel(comm(0, 1), 0, 1, 151936)
    assert (one.vocab_start, one.vocab_per, one.vocab_ranges()) == (0, 151936, [(0, 151936)])
    with pytest.raises(ValueError, match="its communicator is rank 0 of 2"):
        TensorParallel(comm(0, 2), 1, 2, 1003)
    with pytest.raises(ValueError, match="need 0 <= rank < world"):
        TensorParallel(comm(2, 2), 2, 2, 1003)
    with pytest.raises(ValueError, match="must be an int"):
        TensorParallel(comm(0, 1), 0, 1, 1003.0)


# ----------------------------------------------------------------------------- launchers (no GPU: nothing runs)
def fake(shape, dtype, at: int = 1 << 20) -> DeviceArray:
    """An array that only names an address (no allocation): enough for a launcher's checks."""
    return DeviceArray(shape, dtype, ptr=at)


@pytest.fixture
def launches(monkeypatch):
    """The embedding launchers' launches, recorded instead of run: (kernel name, grid, arguments)."""
    seen = []

    class Recorder:
        def __init__(self, file, name):
            self.name = name

        def launch(self, grid, block, args, stream, **kw):
            seen.append((self.name, grid, args))

    monkeypatch.setattr(embedding_module, "kernel", Recorder)
    return seen


def test_the_embedding_launchers_pass_the_first_row_id(launches):
    bf16 = ml_dtypes.bfloat16
    tokens, table, out = fake((5,), np.int32), fake((256, 64), bf16), fake((5, 64), np.float32)
    embedding_module.embedding(tokens, table, out, None)
    embedding_module.embedding(tokens, table, out, None, first=502)
    step = fake((64,), np.uint8)
    ids, src = DeviceArray((5,), np.int32, ptr=step.ptr), DeviceArray((5,), np.int32, ptr=step.ptr + 32)
    embedding_module.fetch_step(step, step, ids, src, fake((8,), np.int32), None, embed=(table, out), first=753)
    assert [(name, args[-1].value, args[-2].value) for name, _, args in launches] == \
        [("embedding", 0, 256), ("embedding", 502, 256), ("fetch_step", 753, 256)]
    for bad in (-1, True, 2.0, 2**31):
        with pytest.raises(ValueError, match="vocabulary id of the table's row 0"):
            embedding_module.embedding(tokens, table, out, None, first=bad)
    assert len(launches) == 3


def test_copy_columns_checks_before_the_driver():
    dst, src = fake((3, 1003), np.float32), fake((3, 256), np.float32, at=1 << 24)
    copy_columns(dst, 1003, src, 0, 0, None)  # nothing to copy: no driver call (there is no GPU here)
    copy_columns(fake((0, 8), np.float32), 0, fake((0, 8), np.float32), 0, 8, None)
    with pytest.raises(ValueError, match="251 columns from 0"):
        copy_columns(dst, 753, src, 0, 251, None)  # past dst's 1003 columns
    with pytest.raises(ValueError, match="257 columns"):
        copy_columns(dst, 0, src, 0, 257, None)
    with pytest.raises(ValueError, match="one dtype and row count"):
        copy_columns(dst, 0, fake((4, 256), np.float32), 0, 8, None)
    with pytest.raises(ValueError, match="one dtype and row count"):
        copy_columns(dst, 0, fake((3, 256), np.int32), 0, 8, None)
