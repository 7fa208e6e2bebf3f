"""Model configuration: a Hugging Face `config.json` into a validated, frozen dataclass, one per family.

Two families share one decoder shape (pre-norm layers, GQA attention with RMSNorm on each head's q and
k before RoPE, an untied or tied LM head) and differ where a class attribute says so:

    Qwen3Config    (model_type "qwen3")    norms input_layernorm / post_attention_layernorm,
                                           MLP gated SiLU: down(silu(gate(x)) * up(x)), plain RoPE
    ApertusConfig  (model_type "apertus")  norms attention_layernorm / feedforward_layernorm,
                                           MLP xIELU: down(xielu(up(x))) with four learned scalars a layer,
                                           RoPE with llama3 frequency scaling (`rope_scaling`)

Only the fields the forward pass needs are kept. Anything the engine cannot run (another architecture,
another RoPE scaling, attention bias, sliding windows) is rejected with a message that names the field,
rather than silently computing something else. `read_config` picks the class from `model_type`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config.json the engine cannot use; the message names the file and the field."""


@dataclass(slots=True, frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (transformers' rope_type "llama3"): rotary wavelengths shorter
    than original_max_position_embeddings / high_freq_factor are kept, those longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, and the band between is
    interpolated smoothly (model/reference.py llama3_inv_freq)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"rope_scaling.{name} must be a positive number, got {value!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                              f"low_freq_factor ({self.low_freq_factor})")
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"rope_scaling.original_max_position_embeddings must be a positive integer, "
                              f"got {value!r}")

    def to_hf_dict(self) -> dict:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


@dataclass(slots=True, frozen=True)
class _DecoderConfig:
    """The fields and checks both families share. A family subclass sets these class attributes
    (plain attributes, not dataclass fields, so `dataclasses.fields` and `replace` see only the numbers):

        family               "qwen3" or "apertus": config.json's model_type
        display_name         for messages: "Qwen3"
        architecture         transformers' class, config.json "architectures"
        hidden_act           config.json "hidden_act"
        mlp                  "gated_silu" or "xielu" (model/reference.py, model/checkpoint.py)
        norm_names           a layer's norm before attention and before the MLP, as tensors are named
        mlp_matrices         [intermediate, hidden] matrices a layer's MLP has
        mlp_scalars          learned scalars a layer's MLP has (xIELU's four)
        accepts_llama3_rope  whether config.json may ask for llama3 RoPE scaling
    """
    accepts_llama3_rope = False

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
    rope_scaling: Llama3RopeScaling | None = None

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
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ConfigError(f"rope_scaling must be None or a Llama3RopeScaling, got {self.rope_scaling!r}")

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
        mlp = self.mlp_matrices * d * f + self.mlp_scalars
        per_layer = d * self.qkv_size + self.q_size * d + mlp + 2 * d + 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + L * per_layer + d + head

    # ------------------------------------------------------------------ config.json
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json"):
        model_type = raw.get("model_type")
        if model_type != cls.family:
            raise ConfigError(f"{source}: model_type is {model_type!r}, not {cls.family!r}")
        architectures = raw.get("architectures")
        if architectures and cls.architecture not in architectures:
            raise ConfigError(f"{source}: architectures {architectures!r} lacks {cls.architecture!r}; TileInfer "
                              f"runs the causal LM only")
        if raw.get("attention_bias") is True:
            raise ConfigError(f"{source}: attention_bias=True is not supported")
        if raw.get("hidden_act", cls.hidden_act) != cls.hidden_act:
            raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported for "
                              f"{cls.display_name} (only {cls.hidden_act!r})")
        cls._check_family_fields(raw, source)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        kwargs = {k: raw[k] for k in required}
        # transformers derives head_dim from the hidden size when config.json has none (Apertus' has none).
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        derivable = isinstance(hidden, int) and isinstance(heads, int) and heads > 0
        kwargs["head_dim"] = raw.get("head_dim", hidden // heads if derivable else None)
        theta, kwargs["rope_scaling"] = cls._rope_from(raw, source)
        tied = raw.get("tie_word_embeddings", defaults["tie_word_embeddings"])
        if not isinstance(tied, bool):  # bool("false") is True: a string would silently tie the LM head
            raise ConfigError(f"{source}: tie_word_embeddings must be true or false, got {tied!r}")
        eos = raw.get("eos_token_id", defaults["eos_token_id"])
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        kwargs.update(
            rms_norm_eps=raw.get("rms_norm_eps", defaults["rms_norm_eps"]),
            rope_theta=float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta,
            max_position_embeddings=raw.get("max_position_embeddings", defaults["max_position_embeddings"]),
            tie_word_embeddings=tied,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
        )
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def _check_family_fields(cls, raw: dict, source: str) -> None:
        """Fields only one family has that the engine cannot honour."""

    @classmethod
    def _rope_from(cls, raw: dict, source: str) -> tuple[float, Llama3RopeScaling | None]:
        """(rope_theta, scaling) from transformers 4's rope_theta + rope_scaling or transformers 5's
        rope_parameters (which holds the theta too)."""
        scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if not isinstance(scaling, dict):
            raise ConfigError(f"{source}: rope_scaling must be an object, got {scaling!r}")
        theta = raw.get("rope_theta", scaling.get("rope_theta", cls.__dataclass_fields__["rope_theta"].default))
        rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
        if rope_type == "default":
            return theta, None
        if rope_type != "llama3" or not cls.accepts_llama3_rope:
            kinds = "'default' or 'llama3'" if cls.accepts_llama3_rope else "only plain RoPE"
            raise ConfigError(f"{source}: rope scaling {rope_type!r} is not supported for {cls.display_name} "
                              f"({kinds})")
        names = [f.name for f in dataclasses.fields(Llama3RopeScaling)]
        missing = [name for name in names if name not in scaling]
        if missing:  # transformers requires them all too
            raise ConfigError(f"{source}: llama3 rope scaling needs {', '.join(missing)}")
        try:
            return theta, Llama3RopeScaling(**{name: scaling[name] for name in names})
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path):
        raw, source = _read_json_config(path)
        return cls.from_dict(raw, source=source)

    def _hf_common(self) -> dict:
        """The config.json keys both families' transformers configs share."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope_scaling"}
        d.update(architectures=[self.architecture], model_type=self.family, hidden_act=self.hidden_act,
                 attention_bias=False, attention_dropout=0.0, initializer_range=0.02, use_cache=True)
        return d


@dataclass(slots=True, frozen=True)
class Qwen3Config(_DecoderConfig):
    family = "qwen3"
    display_name = "Qwen3"
    architecture = "Qwen3ForCausalLM"
    hidden_act = "silu"
    mlp = "gated_silu"
    norm_names = ("input_layernorm", "post_attention_layernorm")
    mlp_matrices = 3
    mlp_scalars = 0

    def __post_init__(self) -> None:
        _DecoderConfig.__post_init__(self)
        if self.rope_scaling is not None:
            raise ConfigError("Qwen3 uses plain RoPE: rope_scaling must be None")

    @classmethod
    def _check_family_fields(cls, raw: dict, source: str) -> None:
        if raw.get("use_sliding_window") is True:
            raise ConfigError(f"{source}: use_sliding_window=True is not supported")

    def to_hf_dict(self) -> dict:
        """The config.json a Hugging Face Qwen3 checkpoint carries (loads in transformers unchanged)."""
        d = self._hf_common()
        d.update(rope_scaling=None, use_sliding_window=False, sliding_window=None,
                 max_window_layers=self.num_hidden_layers, torch_dtype="bfloat16")
        return d


@dataclass(slots=True, frozen=True)
class ApertusConfig(_DecoderConfig):
    """Swiss AI's Apertus (transformers' ApertusForCausalLM); defaults are transformers' ApertusConfig's."""
    family = "apertus"
    display_name = "Apertus"
    architecture = "ApertusForCausalLM"
    hidden_act = "xielu"
    mlp = "xielu"
    norm_names = ("attention_layernorm", "feedforward_layernorm")
    mlp_matrices = 2
    mlp_scalars = 4        # xIELU's alpha_p, alpha_n, beta, eps
    accepts_llama3_rope = True
    pad_token_id = 3       # config.json's, written as transformers' ApertusConfig has it

    rms_norm_eps: float = 1e-5
    rope_theta: float = 12_000_000.0
    max_position_embeddings: int = 65_536
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    rope_scaling: Llama3RopeScaling | None = Llama3RopeScaling()

    @classmethod
    def _rope_from(cls, raw: dict, source: str) -> tuple[float, Llama3RopeScaling | None]:
        if not (raw.get("rope_scaling") or raw.get("rope_parameters")):  # transformers' default: llama3
            return raw.get("rope_theta", cls.__dataclass_fields__["rope_theta"].default), Llama3RopeScaling()
        return super(ApertusConfig, cls)._rope_from(raw, source)

    def to_hf_dict(self) -> dict:
        """config.json as transformers writes it for ApertusForCausalLM (4.56's rope_theta + rope_scaling,
        which transformers 5 also reads). head_dim is written although Apertus' own files leave it out
        (transformers then derives hidden_size / num_attention_heads, which the presets equal)."""
        d = self._hf_common()
        d.update(rope_scaling=None if self.rope_scaling is None else self.rope_scaling.to_hf_dict(),
                 pad_token_id=self.pad_token_id, dtype="bfloat16")
        return d


ModelConfig = Qwen3Config | ApertusConfig
FAMILIES: dict[str, type[_DecoderConfig]] = {c.family: c for c in (Qwen3Config, ApertusConfig)}


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    """The family's config for a parsed config.json, chosen by its model_type."""
    architectures = raw.get("architectures")
    if isinstance(architectures, list) and any(isinstance(a, str) and a.startswith("DFlash") for a in architectures):
        raise ConfigError(f"{source}: a DFlash drafter ({', '.join(architectures)}), not a model that runs on its "
                          f"own; pass its directory as draft_model beside its target model")
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ConfigError(f"{source}: model_type is {model_type!r}; TileInfer runs "
                          f"{' and '.join(map(repr, FAMILIES))} models only")
    return family.from_dict(raw, source=source)


def read_config(path: str | Path) -> ModelConfig:
    """config.json (or a checkpoint directory holding one) as its family's config."""
    raw, source = _read_json_config(path)
    return config_from_dict(raw, source=source)


def _read_json_config(path: str | Path) -> tuple[dict, str]:
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
    return raw, str(path)


# The real shapes (from their published config.json files) and tiny ones for CPU tests.
PRESETS: dict[str, ModelConfig] = {
    "tiny": Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                        max_position_embeddings=4096, tie_word_embeddings=True),
    "qwen3-0.6b": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    # Tensor parallelism's target: 64 query heads, 8 KV heads of 128 (Qwen/Qwen3-32B's config.json).
    "qwen3-32b": Qwen3Config(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                             num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    # Apertus' tiny preset has the byte-level tokenizer's 384 tokens (model/apertus_tokenizer.py) and
    # head_dim 128 = hidden_size / num_attention_heads, as the kernels and transformers both want.
    # The real ones end generation at <|assistant_end|> (68), as the instruct models' config.json says.
    "apertus-tiny": ApertusConfig(vocab_size=384, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                  max_position_embeddings=4096, eos_token_id=68),
    "apertus-8b": ApertusConfig(vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, eos_token_id=68),
    "apertus-70b": ApertusConfig(vocab_size=131072, hidden_size=8192, intermediate_size=43008, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, eos_token_id=68),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
