"""Tensor parallelism's arithmetic: how a model's weights split over `world` ranks, and the float32 reference
run shard by shard.

The split is the usual one (Megatron-LM's, as vLLM and SGLang run it):
    q_proj, k_proj, v_proj      column-parallel by heads: rank r holds query heads [r H/N, (r+1) H/N) and KV
                                heads [r KV/N, (r+1) KV/N) (its KV cache holds those KV heads only)
    o_proj                      row-parallel: the input columns of the rank's query heads; each rank's
                                product is a partial sum, and one all-reduce per layer adds them
    gate_proj, up_proj          column-parallel: intermediate rows [r I/N, (r+1) I/N)
    down_proj                   row-parallel: those intermediate columns; a second all-reduce per layer
    embed_tokens, lm_head       vocabulary-parallel: rank r holds rows [r V', (r+1) V') with V' = ceil(V / N)
                                (the last rank fewer); each rank embeds the tokens in its range (zero rows
                                elsewhere, added by an all-reduce) and computes the logits of its range
                                (gathered)
    norms, q_norm, k_norm,      whole on every rank (xIELU's four scalars too: they act element by element
    xIELU scalars               on each rank's own intermediate columns)
Every rank then runs the ordinary forward over its local shapes (`local_config`) with two all-reduces a layer.

`TensorParallelReference` runs that with the numpy reference, rank by rank, adding the partial sums where the
all-reduces stand: tests hold it equal to the unsharded forward (tests/test_sharding.py).

On the GPU a rank loads its weights through `ShardedCheckpoint` (a checkpoint view DeviceWeights reads) and
its forward (model/forward.py) takes a `TensorParallel`, its place in the group and its communicator.
Its embedding and LM head hold `vocab_part` rows, zero-padded past the rank's range, so that every rank's
logits part has one width for the all-gather.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .checkpoint import expected_tensors
from .config import ConfigError, ModelConfig
from .reference import ReferenceModel, _rounding, rms_norm

if TYPE_CHECKING:
    from ..cuda.nccl import Communicator

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def check_world(config: ModelConfig, world: int) -> None:
    """ConfigError unless `world` ranks can split this model: a positive count dividing the KV heads (and
    so the query heads) and the intermediate size into 16-byte rows."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {world!r}")
    kv, inter = config.num_key_value_heads, config.intermediate_size
    if kv % world:
        ways = ", ".join(str(n) for n in range(1, kv + 1) if kv % n == 0)
        raise ConfigError(f"tensor_parallel_size {world} does not divide the model's {kv} KV heads (the KV cache is "
                          f"split by KV heads); choose one of {ways}")
    if inter % world or (inter // world) % 8:
        raise ConfigError(f"tensor_parallel_size {world} does not split intermediate_size {inter} into rows of a "
                          f"multiple of 8")


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """The vocabulary rows [start, stop) rank `rank` of `world` holds (ceil-div slices; the last may be short)."""
    per = -(-vocab_size // world)
    return min(vocab_size, rank * per), min(vocab_size, (rank + 1) * per)


def vocab_part(vocab_size: int, world: int) -> int:
    """Rows of every rank's embedding and LM head on the GPU: the longest range (vocab_range's), rounded up to
    a multiple of 8 (the products take 16-byte weight rows); the rows past a rank's range are zeros."""
    per = -(-vocab_size // world)
    return -(-per // 8) * 8


def local_config(config: ModelConfig, rank: int, world: int) -> ModelConfig:
    """The shapes rank `rank` of `world` runs: its heads, KV heads, intermediate rows and vocabulary rows."""
    check_world(config, world)
    start, stop = vocab_range(config.vocab_size, rank, world)
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world,
                               num_key_value_heads=config.num_key_value_heads // world,
                               intermediate_size=config.intermediate_size // world, vocab_size=stop - start)


def _leaf(name: str) -> str | None:
    """The module a weight belongs to ("q_proj" of "model.layers.0.self_attn.q_proj.weight"); None for a non-weight."""
    return name.rsplit(".", 2)[-2] if name.endswith(".weight") else None


def shard_rows(config: ModelConfig, name: str, shape: tuple[int, ...], rank: int, world: int
               ) -> tuple[int, int] | None:
    """The rows [start, stop) that are rank `rank`'s slice of the weight `name` of `shape`, where the slice is rows
    (the vocabulary tensors and the column-parallel linears); None where it is not."""
    if name in VOCAB_TENSORS:
        return vocab_range(config.vocab_size, rank, world)
    if _leaf(name) in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # whole heads / rows (check_world)
        per = shape[0] // world
        return rank * per, (rank + 1) * per
    return None


def shard_tensor(config: ModelConfig, name: str, tensor: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s slice of the weight `name` (Hugging Face names, [out, in] linears); a view where the
    slice is rows, a copy where it is columns (row-parallel products)."""
    rows = shard_rows(config, name, tensor.shape, rank, world)
    if rows is not None:
        return tensor[rows[0]:rows[1]]
    if _leaf(name) in ("o_proj", "down_proj"):
        per = tensor.shape[1] // world
        return np.ascontiguousarray(tensor[:, rank * per:(rank + 1) * per])
    return tensor  # norms, q_norm / k_norm, xIELU's scalars: whole on every rank


def shard(config: ModelConfig, weights: dict[str, np.ndarray], rank: int, world: int
          ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(local_config, the rank's weights under their Hugging Face names)."""
    return local_config(config, rank, world), {name: shard_tensor(config, name, w, rank, world)
                                               for name, w in weights.items()}


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group, as its forward and runner read it. The communicator is the
    caller's (a runner never closes it); vocab_size is the whole model's, which sets each rank's range."""
    comm: Communicator
    rank: int
    world: int
    vocab_size: int

    def __post_init__(self) -> None:
        for name in ("rank", "world", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"TensorParallel.{name} must be an int, got {value!r}")
        if not (self.world >= 1 and 0 <= self.rank < self.world and self.vocab_size >= 1):
            raise ValueError(f"TensorParallel: rank {self.rank} of {self.world} over {self.vocab_size} tokens; need "
                             f"0 <= rank < world and a vocabulary")
        if (self.comm.rank, self.comm.world_size) != (self.rank, self.world):
            raise ValueError(f"TensorParallel: rank {self.rank} of {self.world}, but its communicator is rank "
                             f"{self.comm.rank} of {self.comm.world_size}")

    @property
    def vocab_per(self) -> int:
        """Rows of every rank's embedding and LM head, and the width of every rank's logits part."""
        return vocab_part(self.vocab_size, self.world)

    @property
    def vocab_start(self) -> int:
        """The vocabulary id of this rank's first embedding and LM head row."""
        return vocab_range(self.vocab_size, self.rank, self.world)[0]

    def vocab_ranges(self) -> list[tuple[int, int]]:
        """Every rank's vocabulary ids [start, stop), in rank order: the real columns of its logits part."""
        return [vocab_range(self.vocab_size, r, self.world) for r in range(self.world)]


class ShardedCheckpoint:
    """Rank `rank` of `world`'s view of a checkpoint, loaded by DeviceWeights as a checkpoint is:
        config        the rank's shapes (local_config) with vocab_size = vocab_part(V, world)
        read(name)    the rank's slice of the tensor (shard_tensor); the embedding and the LM head zero-padded
                      to vocab_part rows (row i is vocabulary id vocab_range(...)[0] + i; the last rank's range
                      is short), so that every rank's logits part has one width for the all-gather. A tied
                      model's LM head is this embedding, as on one GPU.
        total_bytes   the bytes of the rank's tensors as bfloat16 (what DeviceWeights uploads)
    The rest a runner reads (path, eos_token_ids, chat_template, tokenizer(); full_config) is the checkpoint's."""

    def __init__(self, checkpoint, rank: int, world: int):
        full = checkpoint.config
        check_world(full, world)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
        self.checkpoint, self.rank, self.world, self.full_config = checkpoint, rank, world, full
        self.vocab_rows = vocab_part(full.vocab_size, world)
        self.config = dataclasses.replace(local_config(full, rank, world), vocab_size=self.vocab_rows)

    def read(self, name: str) -> np.ndarray:
        shape = self.checkpoint.tensors[name].shape
        rows = shard_rows(self.full_config, name, shape, self.rank, self.world)
        if rows is not None:  # only the rank's rows are read (or, dummy weights, made)
            tensor = self.checkpoint.read(name, rows)
        else:
            tensor = shard_tensor(self.full_config, name, self.checkpoint.read(name), self.rank, self.world)
        if name not in VOCAB_TENSORS or tensor.shape[0] == self.vocab_rows:
            return tensor
        padded = np.zeros((self.vocab_rows, *tensor.shape[1:]), tensor.dtype)  # [vocab_part, hidden]
        padded[:tensor.shape[0]] = tensor
        return padded

    @property
    def total_bytes(self) -> int:
        return sum(2 * math.prod(shape) for shape in expected_tensors(self.config).values())

    @property
    def path(self):
        return self.checkpoint.path

    @property
    def eos_token_ids(self) -> list[int]:
        return self.checkpoint.eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self.checkpoint.chat_template

    def tokenizer(self):
        return self.checkpoint.tokenizer()


class TensorParallelReference:
    """The float32 reference split over `world` ranks (each a ReferenceModel of its local shapes), run in step:
    per layer each rank's attention and MLP partial sums, added where the all-reduces stand; the embedding
    added over the ranks' vocabulary ranges; the logits gathered."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], world: int):
        self.config, self.world = config, world
        self.ranks = [ReferenceModel(*shard(config, weights, r, world)) for r in range(world)]
        self.ranges = [vocab_range(config.vocab_size, r, world) for r in range(world)]

    def forward(self, token_ids, *, bf16_activations: bool = False) -> np.ndarray:
        """Logits of every token of a prompt at positions 0.. (as ReferenceModel.forward). # [n, vocab]"""
        ids = np.asarray(token_ids, np.int64)
        positions = np.arange(len(ids))
        caches = [m.new_cache() for m in self.ranks]
        starts = [cache.append_positions(positions) for cache in caches]
        r, eps = _rounding(bf16_activations), self.config.rms_norm_eps
        h = self._embed(ids)
        for i in range(self.config.num_hidden_layers):
            x = r(rms_norm(h, self.ranks[0].layers[i].input_norm, eps))
            h = h + sum(m._attention_block(m.layers[i], x, positions, cache, i, start, r)   # all-reduce
                        for m, cache, start in zip(self.ranks, caches, starts))
            x = r(rms_norm(h, self.ranks[0].layers[i].post_norm, eps))
            h = h + sum(m.layers[i].mlp(x, r) for m in self.ranks)                           # all-reduce
        x = r(rms_norm(h, self.ranks[0].norm, eps))
        return np.concatenate([x @ m.lm_head.T for m in self.ranks], axis=1)                 # all-gather

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        """Each rank's rows for the tokens in its range, zero elsewhere, added over the ranks. # [n, hidden]"""
        h = np.zeros((len(ids), self.config.hidden_size), np.float32)
        for m, (start, stop) in zip(self.ranks, self.ranges):
            mine = (ids >= start) & (ids < stop)
            h[mine] += m.embed[ids[mine] - start]
        return h
