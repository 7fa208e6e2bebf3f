"""A Hugging Face Qwen3 or Apertus checkpoint directory, opened and checked before anything touches the GPU.

Layout (what transformers' save_pretrained writes):
  config.json                               -> Qwen3Config or ApertusConfig (by model_type), or for a
                                               draft directory (open_draft) a DFlashConfig
  model.safetensors                         one file of weights, or
  model.safetensors.index.json + shards     {"weight_map": {tensor name: shard file name}}
  generation_config.json (optional)         eos_token_id: int or list
  tokenizer.json, tokenizer_config.json     tokenizer and chat template

`Checkpoint.open` checks that every tensor the forward needs is there with its shape and a float
dtype, and that nothing unexpected is (a different architecture would otherwise load "fine").
Problems raise CheckpointError, whose message names the directory or file and the tensor.

`load_checkpoint(path, "dummy")` (vLLM's load_format name) needs only config.json and the tokenizer files:
its weights are made as they are read, the synthetic generator's for seed 0 (model/synthetic.py, the same
tensors write_checkpoint writes), for benchmarks at sizes whose checkpoints do not fit a disk.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import tokenizers

from tileinfer.model.config import ConfigError, ModelConfig, read_config
from tileinfer.model.dflash_config import DFlashConfig, read_draft_config
from tileinfer.model.safetensors_io import SafetensorsError, SafetensorsFile, TensorInfo
from tileinfer.model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
LOAD_FORMATS = ("auto", "dummy")  # the weights from the directory's files; or made from its config.json


def load_checkpoint(path: str | Path, load_format: str = "auto") -> "Checkpoint":
    """The model checkpoint in `path` by load_format: "auto" opens its weight files (Checkpoint.open), "dummy"
    makes its weights from config.json (DummyCheckpoint)."""
    if load_format == "auto":
        return Checkpoint.open(path)
    if load_format == "dummy":
        return DummyCheckpoint.open(path)
    raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")


class CheckpointError(ValueError):
    """A checkpoint directory the engine cannot load; the message says which file and what to fix."""


def expected_tensors(config: ModelConfig | DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the forward reads, Hugging Face name -> shape ([out, in] for linears)."""
    if isinstance(config, DFlashConfig):
        return dflash_tensors(config)
    d = config.hidden_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for layer in range(config.num_hidden_layers):
        shapes.update(layer_tensors(config, f"model.layers.{layer}."))
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def dflash_tensors(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """A DFlash drafter's weights, as z-lab's checkpoints name them: fc [hidden, layers read x hidden], no bias;
    hidden_norm; Qwen3 layers under "layers.N."; the final norm. Embedding and LM head are the target's."""
    d, decoder = config.hidden_size, config.decoder
    shapes = {"fc.weight": (d, config.feature_size), "hidden_norm.weight": (d,)}
    for layer in range(decoder.num_hidden_layers):
        shapes.update(layer_tensors(decoder, f"layers.{layer}."))
    shapes["norm.weight"] = (d,)
    return shapes


def layer_tensors(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's weights under the prefix `p` ("model.layers.N.")."""
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    attention_norm, mlp_norm = config.norm_names
    return {
        p + attention_norm + ".weight": (d,),
        p + "self_attn.q_proj.weight": (q, d),
        p + "self_attn.k_proj.weight": (kv, d),
        p + "self_attn.v_proj.weight": (kv, d),
        p + "self_attn.o_proj.weight": (d, q),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + mlp_norm + ".weight": (d,),
        **mlp_tensors(config, p + "mlp."),
    }


# xIELU's learned scalars, as transformers' XIELUActivation keeps them: alpha_p and alpha_n are parameters
# of shape [1], beta and eps buffers of shape [] (saved with the weights all the same).
XIELU_SCALARS = {"alpha_p": (1,), "alpha_n": (1,), "beta": (), "eps": ()}


def mlp_tensors(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """One layer's MLP weights under `prefix` ("model.layers.N.mlp."): gated SiLU's three matrices, or
    xIELU's two and its activation's four scalars."""
    d, i = config.hidden_size, config.intermediate_size
    if config.mlp == "gated_silu":
        return {prefix + "gate_proj.weight": (i, d), prefix + "up_proj.weight": (i, d),
                prefix + "down_proj.weight": (d, i)}
    return {prefix + "up_proj.weight": (i, d), prefix + "down_proj.weight": (d, i),
            **{prefix + "act_fn." + name: shape for name, shape in XIELU_SCALARS.items()}}


@dataclass(eq=False)
class Checkpoint:
    path: Path
    config: ModelConfig | DFlashConfig      # a DFlashConfig only when opened with open_draft
    tensors: dict[str, TensorInfo]          # name -> where it lives (TensorInfo.path is the shard)
    eos_token_ids: list[int]
    chat_template: str | None
    _files: dict[Path, SafetensorsFile] = field(repr=False)
    _converted: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        return cls._open(Path(path), read_config)

    @classmethod
    def open_draft(cls, path: str | Path) -> "Checkpoint":
        """A draft directory: a model of its own (as `open`) or a DFlash drafter (config a DFlashConfig)."""
        return cls._open(Path(path), read_draft_config)

    @classmethod
    def open_dflash(cls, path: str | Path) -> "Checkpoint":
        """A DFlash drafter's directory (its config a DFlashConfig); CheckpointError for anything else."""
        ckpt = cls.open_draft(path)
        if not isinstance(ckpt.config, DFlashConfig):
            raise CheckpointError(f"{path}: not a DFlash drafter (architectures has no DFlashDraftModel); load a "
                                  f"draft model with load_model instead")
        return ckpt

    @classmethod
    def _open(cls, path: Path, read) -> "Checkpoint":
        """The checkpoint in `path`, its config.json read by `read` (read_config or read_draft_config)."""
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory; pass a Hugging Face checkpoint directory")
        try:
            config = read(path / "config.json")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        files, tensors = _open_weights(path)
        tensors = _check_tensors(path, config, tensors)
        return cls(path, config, tensors, _eos_token_ids(path), _chat_template(path), files)

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor as bfloat16, or its rows [start, stop) of the first axis (a tensor-parallel rank's part):
        zero-copy when stored as BF16; F16/F32 rounded to nearest even."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        array = self._files[info.path].read(name)
        if rows is not None:
            array = array[rows[0]:rows[1]]
        if info.dtype == "BF16":
            return array
        if not self._converted:
            log.info("%s: converting %s weights to bfloat16 (round to nearest even)", self.path, info.dtype)
            self._converted = True
        return array.astype(ml_dtypes.bfloat16)

    def tokenizer(self) -> tokenizers.Tokenizer:
        try:
            return load_tokenizer(self.path)
        except (FileNotFoundError, ValueError) as e:
            raise CheckpointError(str(e)) from None


class DummyCheckpoint(Checkpoint):
    """load_format="dummy": a directory's config.json and tokenizer, each weight the synthetic generator's for
    seed 0, made when it is read (no weight file is opened, or needed)."""

    SEED = 0

    @classmethod
    def open(cls, path: str | Path) -> "DummyCheckpoint":
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory; load_format='dummy' needs a directory with config.json "
                                  f"(scripts/make_checkpoint.py --config-only writes one)")
        try:
            config = read_config(path / "config.json")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        tensors = {name: TensorInfo(name, "BF16", shape, 0, 2 * int(np.prod(shape)), path)
                   for name, shape in expected_tensors(config).items()}
        return cls(path, config, tensors, _eos_token_ids(path), _chat_template(path), {})

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        from tileinfer.model.synthetic import synthetic_tensor  # synthetic.py imports this module
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        return synthetic_tensor(self.config, self.SEED, name, info.shape, rows=rows)


def _open_weights(path: Path) -> tuple[dict[Path, SafetensorsFile], dict[str, TensorInfo]]:
    # transformers prefers the single file when both exist; so do we.
    if (path / SINGLE_FILE).is_file():
        file = _open_safetensors(path / SINGLE_FILE)
        return {file.path: file}, dict(file.tensors)
    if (path / INDEX_FILE).is_file():
        return _open_shards(path)
    raise CheckpointError(f"{path}: no weights: expected {SINGLE_FILE} or {INDEX_FILE}")


def _open_safetensors(file: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(file)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None


def _open_shards(path: Path) -> tuple[dict[Path, SafetensorsFile], dict[str, TensorInfo]]:
    weight_map = _read_weight_map(path / INDEX_FILE)
    files = {}
    for shard_name in sorted(set(weight_map.values())):
        shard = path / shard_name
        if not shard.is_file():
            raise CheckpointError(f"{path / INDEX_FILE}: lists shard {shard_name!r}, which is missing from {path}")
        files[shard] = _open_safetensors(shard)
    tensors = {}
    for name, shard_name in weight_map.items():
        info = files[path / shard_name].tensors.get(name)
        if info is None:
            raise CheckpointError(f"{path / INDEX_FILE}: says tensor {name!r} is in {shard_name}, but it is not there")
        tensors[name] = info
    # A shard may hold tensors the index does not list; like transformers' index-driven loading, ignore them.
    return files, tensors


def _read_weight_map(index: Path) -> dict[str, str]:
    raw = _read_json(index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected an object with \"weight_map\": {{tensor name: shard file}}")
    for shard_name in set(weight_map.values()):
        if Path(shard_name).name != shard_name or shard_name in ("", ".", ".."):
            raise CheckpointError(f"{index}: shard {shard_name!r} must be a file name inside the checkpoint directory")
    return weight_map


def _read_json(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def _check_tensors(path: Path, config: ModelConfig | DFlashConfig,
                   tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    expected = expected_tensors(config)
    if not isinstance(config, DFlashConfig) and config.tie_word_embeddings:
        # Some tied checkpoints also store the (identical) head; the forward uses the embedding.
        tensors = {name: info for name, info in tensors.items() if name != "lm_head.weight"}
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r}{more}; is this a checkpoint of "
                              f"{config.display_name} with {config.num_hidden_layers} layers?")
    extra = sorted(name for name in tensors if name not in expected)
    if extra:
        raise CheckpointError(f"{path}: {len(extra)} unexpected tensor(s), e.g. {', '.join(extra[:5])}; "
                              f"not a plain {config.display_name} model (or config.json does not match the weights)")
    for name, shape in expected.items():
        info = tensors[name]
        if info.shape != shape and not (is_scalar(shape) and is_scalar(info.shape)):
            raise CheckpointError(f"{info.path}: tensor {name!r} has shape {list(info.shape)}, "
                                  f"but config.json implies {list(shape)}")
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{info.path}: tensor {name!r} has dtype {info.dtype}; only "
                                  f"{', '.join(FLOAT_DTYPES)} weights can be loaded (no quantized checkpoints)")
    return {name: tensors[name] for name in expected}


def is_scalar(shape: tuple[int, ...]) -> bool:
    """One value, stored as [] or [1]: either is taken for the other (exporters differ for xIELU's scalars)."""
    return shape in ((), (1,))


def _eos_token_ids(path: Path) -> list[int]:
    """generation_config.json's eos_token_id if it has one, else config.json's (int or list)."""
    for file in (path / "generation_config.json", path / "config.json"):
        if not file.is_file():
            continue
        raw = _read_json(file)
        eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
        ids = [eos] if isinstance(eos, int) else eos
        if ids is None or ids == []:
            continue
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
        return ids
    return []


def _chat_template(path: Path) -> str | None:
    # Newer transformers save the template as its own file; older ones inside tokenizer_config.json.
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{jinja}: not UTF-8 text ({e})") from None
    config_file = path / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    raw = _read_json(config_file)
    template = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{config_file}: chat_template must be a string, got {type(template).__name__}")
    return template
