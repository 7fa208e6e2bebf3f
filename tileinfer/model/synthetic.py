"""Synthetic Qwen3 and Apertus checkpoints (and DFlash drafters) in exactly the Hugging Face layout, for machines
without a network.

Weights are random bf16 but shaped like a trained model's, so kernels and the engine see realistic
numbers: linears N(0, 0.02) (o_proj and down_proj shrunk by 1/sqrt(2 * layers), so the residual
stream grows like a trained model's), RMSNorm weights 1 + N(0, 0.05), three rotary pairs of layer 0's
k_norm 100x the rest (real Qwen3's first layer has such channels; they exercise INT8 key smoothing)
with the matching q_norm channels 100x smaller (as trained, so attention scores stay moderate),
and a final norm scaled so the logits have a trained model's spread (see `final_norm_scale`; a DFlash drafter's
`norm` likewise, as its logits come from the target's LM head of the same spread). Apertus'
xIELU scalars start where transformers initialises them (a_p 0.8, a_n 0.8, beta 0.5, eps -1e-6), alpha_p
and alpha_n moved by N(0, 0.1) per layer so that no two layers share an activation.

Every chunk of every tensor has its own generator, seeded from (seed, tensor name, chunk index), so
the bytes depend on the seed alone, not on the thread count; chunks are generated on a thread pool
(numpy releases the GIL) and streamed to disk in order.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from tileinfer.model import apertus_tokenizer
from tileinfer.model.checkpoint import INDEX_FILE, SINGLE_FILE, expected_tensors
from tileinfer.model.config import ModelConfig
from tileinfer.model.dflash_config import DFlashConfig
from tileinfer.model.safetensors_io import write_safetensors_streamed
from tileinfer.model.tokenizer import qwen3_tokenizer_json, tokenizer_config

LINEAR_STD = 0.02
NORM_JITTER = 0.05
K_NORM_OUTLIER_GAIN = 100.0
K_NORM_OUTLIER_PAIRS = 3
# Standard deviation of the logits. Random logits are Gaussian, without a trained model's heavy upper
# tail, so they need a wider spread than a trained model's (~3) to be as peaked: over 151,936 Gaussian
# logits, std 5 gives a mean top-1 probability of 0.33 (median 0.30, 10th-90th percentile 0.11-0.61);
# std 4 only 0.19. tests/test_synthetic.py measures it on the tiny preset.
TARGET_LOGIT_STD = 5.0
# Elements per generated piece: fixed, because the chunk index is part of each generator's seed.
CHUNK_ELEMENTS = 1 << 22
BF16 = np.dtype(ml_dtypes.bfloat16)

GENERATION_CONFIG = {
    "bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
    "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
}


def final_norm_scale(hidden_size: int) -> float:
    """Gain of model.norm that gives logits of std TARGET_LOGIT_STD.

    The normed hidden state has RMS 1 per channel times the gain g, and each LM-head row has std
    LINEAR_STD, so a logit has std about g * LINEAR_STD * sqrt(hidden_size).
    """
    return TARGET_LOGIT_STD / (LINEAR_STD * math.sqrt(hidden_size))


# xIELU's stored values at transformers' initialisation (mean, std): alpha_p = softplus^-1(0.8),
# alpha_n = softplus^-1(0.8 - beta).
XIELU_INIT = {"alpha_p": (math.log(math.expm1(0.8)), 0.1), "alpha_n": (math.log(math.expm1(0.3)), 0.1),
              "beta": (0.5, 0.0), "eps": (-1e-6, 0.0)}


def tensor_init(name: str, config: ModelConfig) -> tuple[float, float]:
    """(mean, std) of the normal distribution `name` is drawn from."""
    if ".act_fn." in name:
        return XIELU_INIT[name.rsplit(".", 1)[1]]
    if name in ("model.norm.weight", "norm.weight"):  # a model's final norm, a DFlash drafter's
        gain = final_norm_scale(config.hidden_size)
        return gain, gain * NORM_JITTER
    if name.endswith("norm.weight"):                 # layer norms, q_norm, k_norm
        return 1.0, NORM_JITTER
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, LINEAR_STD / math.sqrt(2 * config.num_hidden_layers)
    return 0.0, LINEAR_STD                            # embeddings, lm_head, other linears


def generate_chunk(config: ModelConfig, seed: int, name: str, index: int, size: int) -> np.ndarray:
    """Chunk `index` (of CHUNK_ELEMENTS each, the last one shorter) of tensor `name`, as flat bf16."""
    rng = np.random.default_rng(_entropy(seed, name, index))
    values = rng.standard_normal(size, dtype=np.float32)
    mean, std = tensor_init(name, config)
    values *= np.float32(std)
    values += np.float32(mean)
    if name == "model.layers.0.self_attn.k_norm.weight":    # small: always a single chunk
        values[outlier_channels(config, seed)] *= np.float32(K_NORM_OUTLIER_GAIN)
    if name == "model.layers.0.self_attn.q_norm.weight":
        # A trained model pairs its large key channels with small query channels: the scores stay
        # moderate. Without this, layer 0's attention scores would have a std of ~25 and every
        # bf16 rounding would move which key a query attends to.
        values[outlier_channels(config, seed)] /= np.float32(K_NORM_OUTLIER_GAIN)
    return values.astype(BF16)                      # round to nearest even


def synthetic_tensor(config: ModelConfig, seed: int, name: str, shape: tuple[int, ...],
                     rows: tuple[int, int] | None = None, workers: int | None = None) -> np.ndarray:
    """Tensor `name`, bf16 of `shape`, or its rows [start, stop) of the first axis: what write_checkpoint writes
    for it (load_format="dummy" reads it, a tensor-parallel rank only its rows). Only the chunks holding those
    rows are generated, on `workers` threads (default: every core; numpy's generators let go of the GIL)."""
    numel = math.prod(shape)
    start, stop = (0, shape[0]) if rows is None else rows
    if not 0 <= start <= stop <= shape[0]:
        raise ValueError(f"rows {rows} of a tensor of {shape[0]} rows")
    row = numel // shape[0] if shape[0] else 0
    first, last = start * row, stop * row  # the elements asked for
    chunks = [(i, n) for i, n in _chunk_sizes(numel) if i * CHUNK_ELEMENTS < last and (i * CHUNK_ELEMENTS + n) > first]
    if not chunks:
        return np.zeros((stop - start, *shape[1:]), BF16)
    make = functools.partial(generate_chunk, config, seed, name)
    if len(chunks) == 1:
        parts = [make(*chunks[0])]
    else:
        with ThreadPoolExecutor(min(workers or os.cpu_count() or 1, len(chunks))) as pool:
            parts = list(pool.map(lambda chunk: make(*chunk), chunks))
    flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
    offset = chunks[0][0] * CHUNK_ELEMENTS
    return flat[first - offset:last - offset].reshape((stop - start, *shape[1:]))


def outlier_channels(config: ModelConfig, seed: int) -> np.ndarray:
    """The channels of layer 0's outlier rotary pairs (i, i + head_dim/2), the same for q_norm and k_norm."""
    half = config.head_dim // 2
    rng = np.random.default_rng(_entropy(seed, "k_norm outliers", 0))
    pairs = rng.choice(half, K_NORM_OUTLIER_PAIRS, replace=False)
    return np.concatenate([pairs, pairs + half])


def _entropy(seed: int, name: str, index: int) -> list[int]:
    digest = hashlib.sha256(name.encode()).digest()
    return [seed, *np.frombuffer(digest[:16], dtype=np.uint32).tolist(), index]


def plan_shards(shapes: dict[str, tuple[int, ...]], max_shard_bytes: int) -> list[list[str]]:
    """Tensors, in order, grouped into shards of at most max_shard_bytes (a bigger tensor goes alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * BF16.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def write_checkpoint(config: ModelConfig | DFlashConfig, out: str | Path, seed: int = 0,
                     max_shard_bytes: int = 4 * 10**9, workers: int | None = None, progress: bool = True) -> int:
    """Write a complete HF-layout checkpoint for `config` into `out`; returns the weight bytes written."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = expected_tensors(config)
    shards = plan_shards(shapes, max_shard_bytes)
    file_names = shard_file_names(len(shards))
    total = _write_weights(config, out, seed, shapes, dict(zip(file_names, shards)), workers, progress)
    if len(shards) > 1:
        weight_map = {name: file_name for names, file_name in zip(shards, file_names) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out / INDEX_FILE, index)
    _remove_stale_weights(out, keep=set(file_names) | ({INDEX_FILE} if len(shards) > 1 else set()))
    write_text_files(config, out)
    return total


def _write_weights(config: ModelConfig, out: Path, seed: int, shapes: dict[str, tuple[int, ...]],
                   shards: dict[str, list[str]], workers: int | None, progress: bool) -> int:
    """Generate every tensor chunk by chunk on a thread pool and stream them into the shard files."""
    total = sum(math.prod(shape) for shape in shapes.values()) * BF16.itemsize
    jobs = [(name, index, size) for name in shapes for index, size in _chunk_sizes(math.prod(shapes[name]))]
    make = functools.partial(generate_chunk, config, seed)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress) as bar:
        chunks = _counted(_ordered_parallel(make, jobs, workers or os.cpu_count() or 1), bar)
        for file_name, names in shards.items():
            layout = {name: (BF16, shapes[name]) for name in names}
            count = sum(len(_chunk_sizes(math.prod(shapes[name]))) for name in names)
            write_safetensors_streamed(out / file_name, layout, islice(chunks, count))
    return total


def write_text_files(config: ModelConfig | DFlashConfig, out: Path) -> None:
    """config.json, generation_config.json, tokenizer.json and tokenizer_config.json (the family's); a DFlash
    drafter's directory has config.json only (it uses its target's tokenizer)."""
    _write_json(out / "config.json", config.to_hf_dict())
    if isinstance(config, DFlashConfig):
        return
    if config.family == "apertus":
        generation, tokenizer = apertus_tokenizer.GENERATION_CONFIG, apertus_tokenizer.tokenizer_json()
        tokenizer_settings = apertus_tokenizer.tokenizer_config(model_max_length=config.max_position_embeddings)
    else:
        generation, tokenizer = GENERATION_CONFIG, qwen3_tokenizer_json()
        tokenizer_settings = tokenizer_config(model_max_length=config.max_position_embeddings)
    _write_json(out / "generation_config.json", generation)
    _write_json(out / "tokenizer_config.json", tokenizer_settings)
    (out / "tokenizer.json").write_text(tokenizer, encoding="utf-8")


def _chunk_sizes(numel: int) -> list[tuple[int, int]]:
    """(chunk index, element count) pairs covering a tensor of numel elements."""
    return [(i, min(CHUNK_ELEMENTS, numel - start)) for i, start in enumerate(range(0, numel, CHUNK_ELEMENTS))]


def _ordered_parallel(fn: Callable, jobs: Iterable[tuple], workers: int) -> Iterator:
    """fn(*job) for each job, computed on a thread pool, yielded in job order.

    At most 2 * workers results wait in memory, so a 16 GB checkpoint streams in bounded space.
    """
    window = 2 * workers
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for job in jobs:
            pending.append(pool.submit(fn, *job))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _counted(chunks: Iterator[np.ndarray], bar: tqdm) -> Iterator[np.ndarray]:
    for chunk in chunks:
        bar.update(chunk.nbytes)
        yield chunk


def _remove_stale_weights(out: Path, keep: set[str]) -> None:
    # A previous checkpoint with another shard count would leave files transformers also reads.
    for path in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        if path.name not in keep and path.is_file():
            path.unlink()


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def checkpoints_dir() -> Path:
    """Where `cached_checkpoint` keeps synthetic checkpoints: $TILEINFER_CHECKPOINTS, else the user cache."""
    root = os.environ.get("TILEINFER_CHECKPOINTS")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "tileinfer" / "checkpoints"


def cached_checkpoint(preset_name: str, seed: int = 0, progress: bool = False) -> Path:
    """The synthetic checkpoint of a preset, written on first use and reused afterwards.

    A marker file is written last, so an interrupted write is redone rather than half-used.
    """
    from tileinfer.model.config import preset

    config = preset(preset_name)
    out = checkpoints_dir() / f"{preset_name}-seed{seed}"
    marker = out / ".tileinfer-complete"
    if not marker.is_file():
        write_checkpoint(config, out, seed=seed, progress=progress)
        marker.write_text(json.dumps({"preset": preset_name, "seed": seed}))
    return out
