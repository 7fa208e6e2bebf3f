"""Qwen3 model configuration: Hugging Face `config.json` into a validated, frozen dataclass.

Only the fields the forward pass needs are kept. Anything the engine cannot run (another
architecture, rope scaling, attention bias, sliding windows) is rejected with a message
that names the field, rather than silently computing something else.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config.json the engine cannot use; the message names the file and the field."""


@dataclass(slots=True, frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40_960
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 16:
            raise ConfigError(f"head_dim must be a multiple of 16 for the attention kernels, got {self.head_dim}")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % 8:
                raise ConfigError(f"{name} must be a multiple of 8 (16-byte weight rows), got {getattr(self, name)}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1):
            raise ConfigError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")

    # Derived sizes, used by weights, kernels and sizing.
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def num_parameters(self) -> int:
        d, f, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = d * self.qkv_size + self.q_size * d + 3 * d * f + 2 * d + 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + L * per_layer + d + head

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "Qwen3Config":
        model_type = raw.get("model_type")
        if model_type != "qwen3":
            raise ConfigError(f"{source}: model_type is {model_type!r}; TileInfer runs 'qwen3' models only")
        for name, bad in (("attention_bias", True), ("use_sliding_window", True)):
            if raw.get(name) is bad:
                raise ConfigError(f"{source}: {name}={bad} is not supported")
        scaling = raw.get("rope_scaling")
        params = raw.get("rope_parameters") or {}
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or params.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise ConfigError(f"{source}: rope scaling {rope_type!r} is not supported (only plain RoPE)")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        kwargs = {k: raw[k] for k in required}
        kwargs["head_dim"] = raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"]
                                     if isinstance(raw["hidden_size"], int) and isinstance(raw["num_attention_heads"], int)
                                     and raw["num_attention_heads"] > 0 else None)
        theta = raw.get("rope_theta", params.get("rope_theta", 1_000_000.0))
        eos = raw.get("eos_token_id", 151645)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        kwargs.update(
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta) if isinstance(theta, (int, float)) else theta,
            max_position_embeddings=raw.get("max_position_embeddings", 40_960),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
        )
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "Qwen3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no such file (a checkpoint directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path))

    def to_hf_dict(self) -> dict:
        """The config.json a Hugging Face Qwen3 checkpoint carries (loads in transformers unchanged)."""
        d = dataclasses.asdict(self)
        d.update(
            architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
            attention_bias=False, attention_dropout=0.0, initializer_range=0.02, use_cache=True,
            rope_scaling=None, use_sliding_window=False, sliding_window=None,
            max_window_layers=self.num_hidden_layers, torch_dtype="bfloat16",
        )
        return d


# The real Qwen3 shapes (from their published config.json files) and a tiny one for CPU tests.
PRESETS: dict[str, Qwen3Config] = {
    "tiny": Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                        max_position_embeddings=4096, tie_word_embeddings=True),
    "qwen3-0.6b": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}


def preset(name: str) -> Qwen3Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
