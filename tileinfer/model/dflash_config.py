"""A DFlash drafter's config.json (z-lab's `DFlashDraftModel`) as a validated, frozen dataclass.

A DFlash drafter is a small stack of Qwen3 layers that drafts a whole block at once: the last committed
token followed by `block_size - 1` copies of `mask_token_id`, every draft taken by argmax in one forward
whose attention is not causal. It reads the target: the target's hidden states after the layers in
`target_layer_ids` (transformers' `hidden_states[id + 1]`), concatenated, projected by `fc` and normed by
`hidden_norm`, give every drafter layer the keys and values of the context; it borrows the target's
`embed_tokens` and LM head. Its config.json is a Qwen3 one (model_type "qwen3") plus

    architectures   ["DFlashDraftModel"]
    block_size      16                                  (top level, or in dflash_config)
    dflash_config   {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    num_target_layers (optional: the target it was trained for)

Variants the engine cannot run as written (sliding-window or causal drafter layers, a scaled input
embedding, scaled or soft-capped logits, z-lab's DFlash2 with its candidate selector) are refused with a
message naming the field. `check_target` says whether a drafter fits a target.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tileinfer.model.config import PRESETS, ConfigError, ModelConfig, Qwen3Config, _read_json_config, config_from_dict

ARCHITECTURE = "DFlashDraftModel"
DFLASH_NOT_A_MODEL = ("a DFlash drafter is not a model of its own (it drafts from its target's hidden states): pass "
                      "its directory as draft_model (--draft-model) beside the model it drafts for")
# Keys z-lab's code reads with a default, and that default (the only value the engine honours).
NEUTRAL_VALUES = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0,
                  "is_causal": False}


def is_dflash_config(raw: dict) -> bool:
    """Whether a parsed config.json declares a DFlash drafter (of any DFlash architecture)."""
    architectures = raw.get("architectures") or []
    return isinstance(architectures, list) and any(isinstance(a, str) and a.startswith("DFlash")
                                                   for a in architectures)


def is_dflash_dir(path: str | Path) -> bool:
    """Whether `path` (a directory or its config.json) holds a DFlash drafter; False when it has no readable
    config.json (whoever opens it next says what is wrong)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and is_dflash_config(raw)


@dataclass(slots=True, frozen=True)
class DFlashConfig:
    decoder: Qwen3Config            # the drafter's own layers (their shapes, norms' eps, RoPE)
    block_size: int                 # tokens a draft forward takes: the last committed one and block_size - 1 masks
    mask_token_id: int              # the token the masked block positions hold (embedded by the target)
    target_layer_ids: tuple[int, ...]  # the target layers whose outputs form the context features, in order
    num_target_layers: int | None = None  # the target's layer count it was trained for, when config.json says

    display_name = "DFlash"         # for messages (checkpoint.py names the model kind)

    def __post_init__(self) -> None:
        if not isinstance(self.decoder, Qwen3Config):
            raise ConfigError(f"decoder must be a Qwen3Config, got {type(self.decoder).__name__}")
        _check_int("block_size", self.block_size, 2)
        _check_int("mask_token_id", self.mask_token_id, 0)
        if self.mask_token_id >= self.decoder.vocab_size:
            raise ConfigError(f"dflash_config.mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"(vocab_size {self.decoder.vocab_size})")
        ids = self.target_layer_ids
        if not isinstance(ids, tuple) or not ids:
            raise ConfigError(f"dflash_config.target_layer_ids must be a non-empty list of layer indices, got {ids!r}")
        for i in ids:
            _check_int("dflash_config.target_layer_ids[]", i, 0)
        if len(set(ids)) != len(ids):
            raise ConfigError(f"dflash_config.target_layer_ids {list(ids)} names a layer twice")
        if self.num_target_layers is not None:
            _check_int("num_target_layers", self.num_target_layers, 1)
            if max(ids) >= self.num_target_layers:
                raise ConfigError(f"dflash_config.target_layer_ids {list(ids)} reach past num_target_layers "
                                  f"({self.num_target_layers})")

    # The sizes the runners and sizing read, as a model config names them.
    @property
    def hidden_size(self) -> int:
        return self.decoder.hidden_size

    @property
    def num_hidden_layers(self) -> int:
        return self.decoder.num_hidden_layers

    @property
    def num_key_value_heads(self) -> int:
        return self.decoder.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.decoder.head_dim

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of one position's context feature: the captured target layers side by side (fc's input)."""
        return len(self.target_layer_ids) * self.decoder.hidden_size

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size - 1

    def check_target(self, target: ModelConfig, source: str = "draft_model") -> None:
        """ValueError naming the mismatch unless this drafter can run beside `target`."""
        problems = []
        if target.hidden_size != self.hidden_size:
            problems.append(f"its hidden_size {self.hidden_size} differs from the target's {target.hidden_size} "
                            f"(it embeds with the target's embedding)")
        if max(self.target_layer_ids) >= target.num_hidden_layers:
            problems.append(f"its target_layer_ids {list(self.target_layer_ids)} reach past the target's "
                            f"{target.num_hidden_layers} layers")
        if self.num_target_layers is not None and self.num_target_layers != target.num_hidden_layers:
            problems.append(f"it was made for a target of {self.num_target_layers} layers, not "
                            f"{target.num_hidden_layers}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"its vocab_size {self.vocab_size} differs from the target's {target.vocab_size}")
        if problems:
            raise ValueError(f"{source}: this DFlash drafter does not fit the target model: {'; '.join(problems)}")

    # ------------------------------------------------------------------ config.json
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "DFlashConfig":
        architectures = raw.get("architectures") or []
        if ARCHITECTURE not in architectures:
            raise ConfigError(f"{source}: architectures {architectures!r}: TileInfer runs z-lab's {ARCHITECTURE} "
                              f"drafters only (not DFlash2's candidate selector)")
        _check_supported(raw, source)
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError(f"{source}: dflash_config must be an object, got {dflash!r}")
        values = {}
        for name in ("block_size", "mask_token_id", "target_layer_ids"):
            value = dflash.get(name, raw.get(name))
            if value is None:
                raise ConfigError(f"{source}: missing {name} (in dflash_config or at the top level)")
            values[name] = value
        ids = values["target_layer_ids"]
        if not isinstance(ids, list):
            raise ConfigError(f"{source}: dflash_config.target_layer_ids must be a list, got {ids!r}")
        # The layers are Qwen3's: its own checks (shapes, activation, RoPE, no sliding window) apply.
        decoder = Qwen3Config.from_dict({**raw, "architectures": [Qwen3Config.architecture]}, source=source)
        try:
            return cls(decoder=decoder, block_size=values["block_size"], mask_token_id=values["mask_token_id"],
                       target_layer_ids=tuple(ids), num_target_layers=raw.get("num_target_layers"))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "DFlashConfig":
        raw, source = _read_json_config(path)
        return cls.from_dict(raw, source=source)

    def to_hf_dict(self) -> dict:
        """config.json as z-lab's DFlash checkpoints carry it."""
        d = self.decoder.to_hf_dict()
        d.update(architectures=[ARCHITECTURE], block_size=self.block_size,
                 dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
                 layer_types=["full_attention"] * self.num_hidden_layers)
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        return d


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_supported(raw: dict, source: str) -> None:
    """Refuse the DFlash variants the engine does not run (their fields would otherwise be ignored)."""
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
        raise ConfigError(f"{source}: layer_types {layer_types!r}: only full (non-causal) attention drafter layers "
                          f"are supported, not sliding-window ones")
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    for name, neutral in NEUTRAL_VALUES.items():
        value = dflash.get(name, raw.get(name))
        if value is not None and not (isinstance(value, bool) == isinstance(neutral, bool) and value == neutral):
            raise ConfigError(f"{source}: {name}={value!r} is not supported (only {neutral!r})")


def read_draft_config(path: str | Path) -> ModelConfig | DFlashConfig:
    """A draft directory's config: a DFlashConfig for a DFlash drafter, else the model's family config."""
    raw, source = _read_json_config(path)
    return DFlashConfig.from_dict(raw, source) if is_dflash_config(raw) else config_from_dict(raw, source)


def _preset(target: Qwen3Config, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
            target_layer_ids: tuple[int, ...]) -> DFlashConfig:
    decoder = Qwen3Config(vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=128, max_position_embeddings=target.max_position_embeddings)
    return DFlashConfig(decoder=decoder, block_size=16, mask_token_id=151669, target_layer_ids=target_layer_ids,
                        num_target_layers=target.num_hidden_layers)


def _presets() -> dict[str, tuple[str, DFlashConfig]]:
    return {
        # The tiny target has two layers: both are read (the last one's is transformers' final-normed state).
        "dflash-tiny": ("tiny", _preset(PRESETS["tiny"], hidden=128, intermediate=352, layers=2, heads=4, kv_heads=2,
                                        target_layer_ids=(0, 1))),
        # z-lab's Qwen3-4B-DFlash-b16 and Qwen3-8B-DFlash-b16: five Qwen3 layers of the target's width; the
        # layers read are z-lab's spacing from 1 to num_target_layers - 3 (the 8B's published config says
        # [1, 9, 17, 25, 33]; the 4B's shapes give its published 537,427,200 parameters).
        "dflash-qwen3-4b": ("qwen3-4b", _preset(PRESETS["qwen3-4b"], hidden=2560, intermediate=9728, layers=5,
                                                heads=32, kv_heads=8, target_layer_ids=(1, 9, 17, 25, 33))),
        "dflash-qwen3-8b": ("qwen3-8b", _preset(PRESETS["qwen3-8b"], hidden=4096, intermediate=12288, layers=5,
                                                heads=32, kv_heads=8, target_layer_ids=(1, 9, 17, 25, 33))),
    }


DFLASH_PRESETS: dict[str, tuple[str, DFlashConfig]] = _presets()  # name -> (its target's preset, config)
