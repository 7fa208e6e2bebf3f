"""A float32 numpy forward pass of Qwen3 and Apertus: the oracle the kernels and the engine are tested against.

The math follows Hugging Face transformers' Qwen3 and Apertus step by step, in float32:
  per layer:  h = h + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))   on x = first norm(h)
              h = h + mlp(x)                                                    on x = second norm(h)
  then model.norm and the LM head (the embedding when tied).
The families differ in three places, each decided once when the model is built: the norms' names
(input_layernorm / post_attention_layernorm, or attention_layernorm / feedforward_layernorm), the MLP
(Qwen3: down(silu(gate(x)) * up(x)); Apertus: down(xielu(up(x))), GatedSiluMLP or XieluMLP) and the
RoPE frequency table (plain, or with Apertus' llama3 scaling: rope_table).
Clarity over speed, but every step is one batched matmul so a Qwen3-0.6B shape runs on a CPU.

The module-level functions (rms_norm, rope_inv_freq, llama3_inv_freq, apply_rope, attention, block_attention,
silu, xielu) are oracles for kernel tests too. Weights use Hugging Face names and layout (`[out, in]`, y = x @ W.T).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tileinfer.model.checkpoint import expected_tensors as weight_shapes  # one list of HF names and shapes
from tileinfer.model.checkpoint import is_scalar
from tileinfer.model.config import Llama3RopeScaling, ModelConfig

# ---------------------------------------------------------------------------------------------- pieces


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in float32. # same shape as x"""
    x = np.asarray(x, dtype=np.float32)
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (np.float32(1.0) / np.sqrt(mean_square + np.float32(eps))) * weight


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """Rotary frequencies 1 / theta^(2i / head_dim), computed in float64. # [head_dim // 2] float32"""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    return (1.0 / theta ** exponents).astype(np.float32)


def llama3_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling) -> np.ndarray:
    """Rotary frequencies with Llama 3.1's scaling (transformers' rope_type "llama3"), in float64.
    # [head_dim // 2] float32

    A frequency whose wavelength 2 pi / f is below original / high_freq_factor stays; above
    original / low_freq_factor it becomes f / factor; between, it blends the two with weight
    s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor) on f.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    original = scaling.original_max_position_embeddings
    wavelength = 2 * np.pi / freq
    low_band = wavelength > original / scaling.low_freq_factor     # long wavelengths: interpolated
    high_band = wavelength < original / scaling.high_freq_factor   # short wavelengths: kept
    s = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - s) * freq / scaling.factor + s * freq
    out = np.where(low_band, freq / scaling.factor, np.where(high_band, freq, blended))
    return out.astype(np.float32)


def rope_table(config: ModelConfig) -> np.ndarray:
    """The model's rotary frequencies: plain, or scaled as its config's rope_scaling says. # [head_dim // 2]"""
    if config.rope_scaling is None:
        return rope_inv_freq(config.head_dim, config.rope_theta)
    return llama3_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE: x*cos + rotate_half(x)*sin; pairs channel i with i + head_dim/2.

    x: [tokens, heads, head_dim]; positions: [tokens]; inv_freq: [head_dim // 2].
    """
    x = np.asarray(x, dtype=np.float32)
    angle = np.asarray(positions).astype(np.float32)[:, None] * inv_freq[None, :]  # [tokens, head_dim/2]
    angle = np.concatenate([angle, angle], axis=-1)[:, None, :]                  # [tokens, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angle) + rotated * np.sin(angle)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
              q_positions: np.ndarray, k_positions: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention: query head h reads KV head h // (H / KV); key j is visible to
    query i when k_positions[j] <= q_positions[i]. Scale 1/sqrt(head_dim), softmax in float32.

    q: [n, H, hd]; k, v: [m, KV, hd]; returns [n, H, hd].
    """
    visible = np.asarray(k_positions)[None, :] <= np.asarray(q_positions)[:, None]  # [n, m]
    if not visible.any(axis=1).all():
        first = int(np.asarray(q_positions)[~visible.any(axis=1)][0])
        raise ValueError(f"the query at position {first} sees no key (no cached position <= it)")
    return _grouped_attention(q, k, v, visible)


def block_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Grouped-query attention without a mask: every query reads every key (a DFlash drafter's block
    attends to its context and to the whole block, before and after itself). Scale 1/sqrt(head_dim).

    q: [n, H, hd]; k, v: [m, KV, hd] (m >= 1); returns [n, H, hd].
    """
    if k.shape[0] == 0:
        raise ValueError("block attention needs at least one key")
    return _grouped_attention(q, k, v, np.ones((q.shape[0], k.shape[0]), bool))


def _grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Softmax attention of query head h over KV head h // (H / KV), keys masked by visible [n, m]."""
    n, num_heads, head_dim = q.shape
    m, num_kv, _ = k.shape
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv} KV heads evenly")
    group = num_heads // num_kv
    # Heads of one group become extra query rows: [KV, group * n, hd].
    qg = q.reshape(n, num_kv, group, head_dim).transpose(1, 2, 0, 3).reshape(num_kv, group * n, head_dim)
    scores = qg @ k.transpose(1, 2, 0) * np.float32(1.0 / np.sqrt(head_dim))  # [KV, group * n, m]
    scores = scores.reshape(num_kv, group, n, m)
    scores = np.where(visible, scores, np.float32(-np.inf))
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs.reshape(num_kv, group * n, m) @ v.transpose(1, 0, 2)  # [KV, group * n, hd]
    return out.reshape(num_kv, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def _bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (nearest even) and back to float32."""
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives the right limit, -0
        return x / (np.float32(1.0) + np.exp(-x))


def softplus(x) -> np.ndarray:
    """log(1 + exp(x)), without overflow. # same shape as x, float32"""
    return np.logaddexp(np.float32(0.0), np.asarray(x, np.float32))


def xielu(x: np.ndarray, alpha_p, alpha_n, beta, eps) -> np.ndarray:
    """transformers' XIELUActivation from its stored parameters (alpha_p, alpha_n softplus-inverse, beta, eps):

        a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n)
        f(x) = a_p x^2 + beta x                                  for x > 0
               (expm1(min(x, eps)) - x) a_n + beta x             otherwise       # same shape as x, float32
    """
    x = np.asarray(x, np.float32)
    beta, eps = np.float32(beta), np.float32(eps)
    a_p, a_n = softplus(alpha_p), beta + softplus(alpha_n)
    with np.errstate(over="ignore", invalid="ignore"):  # the branch np.where drops may overflow
        positive = a_p * x * x + beta * x
        negative = (np.expm1(np.minimum(x, eps)) - x) * a_n + beta * x
    return np.where(x > 0, positive, negative)


# ---------------------------------------------------------------------------------------------- cache


def _rounding(bf16: bool) -> Callable[[np.ndarray], np.ndarray]:
    """The rounding forward applies (`r` below) where the engine writes bf16: _bf16, or none."""
    return _bf16 if bf16 else (lambda x: x)


class ReferenceCache:
    """Contiguous keys and values per layer (after q/k norm and RoPE, as the paged cache stores them).

    keys[layer], values[layer]: [num_positions, kv_heads, head_dim]; positions: [num_positions].
    Buffers grow by doubling, so appending one token at a time stays cheap.

    int8=True models the INT8 cache (tileinfer/kv/int8.py): every written vector is quantized
    and stored dequantized; with `smoothing` (per layer, the factors c), keys are stored as k / c
    quantized, and the model multiplies its queries by c. `parts` ("kv", "k" or "v") quantizes both
    halves or only the keys or only the values (the other stays exact): a diagnostic, to see which
    half an INT8 cache's error comes from (scripts/kv_fidelity.py --parts). bf16=True stores keys and
    values rounded to bfloat16, as the engine's BF16 cache holds them: the baseline the GPU's fidelity
    figure measures the INT8 cache against (kv_fidelity.py --baseline bf16).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, int8: bool = False,
                 smoothing: list[np.ndarray] | None = None, parts: str = "kv", bf16: bool = False):
        if parts not in ("kv", "k", "v"):
            raise ValueError(f"parts must be 'kv', 'k' or 'v', got {parts!r}")
        if int8 and bf16:
            raise ValueError("a cache is INT8 or BF16, not both")
        self._shape = (num_layers, num_kv_heads, head_dim)
        self.int8 = int8
        self.bf16 = bf16
        self.smoothing = smoothing
        self.parts = parts
        self._k = [np.zeros((0, num_kv_heads, head_dim), np.float32) for _ in range(num_layers)]
        self._v = [np.zeros((0, num_kv_heads, head_dim), np.float32) for _ in range(num_layers)]
        self._positions = np.zeros(0, np.int64)
        self.num_positions = 0

    def __len__(self) -> int:
        return self.num_positions

    @property
    def keys(self) -> list[np.ndarray]:
        return [k[:self.num_positions] for k in self._k]

    @property
    def values(self) -> list[np.ndarray]:
        return [v[:self.num_positions] for v in self._v]

    @property
    def positions(self) -> np.ndarray:
        return self._positions[:self.num_positions]

    def truncate(self, n: int) -> None:
        """Keep the first n positions (later writes overwrite the rest)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self.num_positions:
            raise ValueError(f"cannot truncate a cache of {self.num_positions} positions to {n!r}; "
                             f"n must be an integer in 0..{self.num_positions}")
        self.num_positions = int(n)

    def append_positions(self, positions: np.ndarray) -> int:
        """Make room for len(positions) new entries; returns the index of the first one."""
        start, end = self.num_positions, self.num_positions + len(positions)
        if end > len(self._positions):
            self._grow(max(end, 2 * len(self._positions), 16))
        self._positions[start:end] = positions
        self.num_positions = end
        return start

    def read(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Everything cached for one layer: (keys, values, their positions)."""
        return self.keys[layer], self.values[layer], self.positions

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store one layer's new keys and values at entries start..start+len(k)-1."""
        if self.int8:
            from tileinfer.kv.int8 import dequantize, quantize
            if self.smoothing is not None:
                k = k / self.smoothing[layer]
            if "k" in self.parts:
                k = dequantize(*quantize(k))
            if "v" in self.parts:
                v = dequantize(*quantize(v))
        elif self.bf16:
            import ml_dtypes
            k = k.astype(ml_dtypes.bfloat16).astype(np.float32)
            v = v.astype(ml_dtypes.bfloat16).astype(np.float32)
        self._k[layer][start:start + len(k)] = k
        self._v[layer][start:start + len(v)] = v

    def _grow(self, capacity: int) -> None:
        def grown(old: np.ndarray) -> np.ndarray:
            new = np.zeros((capacity,) + old.shape[1:], old.dtype)
            new[:len(old)] = old
            return new

        self._k = [grown(k) for k in self._k]
        self._v = [grown(v) for v in self._v]
        self._positions = grown(self._positions)


# ---------------------------------------------------------------------------------------------- model


@dataclass(slots=True)
class GatedSiluMLP:
    """Qwen3's MLP: down(silu(gate(x)) * up(x))."""
    gate_proj: np.ndarray   # [intermediate, hidden]
    up_proj: np.ndarray     # [intermediate, hidden]
    down_proj: np.ndarray   # [hidden, intermediate]

    @classmethod
    def from_weights(cls, w: dict[str, np.ndarray], p: str) -> "GatedSiluMLP":
        return cls(w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])

    def __call__(self, x: np.ndarray, r) -> np.ndarray:
        return r(silu(x @ self.gate_proj.T) * (x @ self.up_proj.T)) @ self.down_proj.T


@dataclass(slots=True)
class XieluMLP:
    """Apertus' MLP, not gated: down(xielu(up(x))) with the layer's own four xIELU scalars."""
    up_proj: np.ndarray     # [intermediate, hidden]
    down_proj: np.ndarray   # [hidden, intermediate]
    alpha_p: np.float32     # as stored: softplus-inverse of the x > 0 side's gain
    alpha_n: np.float32     # as stored: softplus-inverse of the x <= 0 side's gain minus beta
    beta: np.float32
    eps: np.float32

    @classmethod
    def from_weights(cls, w: dict[str, np.ndarray], p: str) -> "XieluMLP":
        scalars = [np.float32(w[p + "act_fn." + name].reshape(())) for name in ("alpha_p", "alpha_n", "beta", "eps")]
        return cls(w[p + "up_proj.weight"], w[p + "down_proj.weight"], *scalars)

    def __call__(self, x: np.ndarray, r) -> np.ndarray:
        return r(xielu(x @ self.up_proj.T, self.alpha_p, self.alpha_n, self.beta, self.eps)) @ self.down_proj.T


@dataclass(slots=True)
class _Layer:
    input_norm: np.ndarray  # [hidden]: Qwen3's input_layernorm, Apertus' attention_layernorm
    q_proj: np.ndarray      # [H * hd, hidden]
    k_proj: np.ndarray      # [KV * hd, hidden]
    v_proj: np.ndarray      # [KV * hd, hidden]
    o_proj: np.ndarray      # [hidden, H * hd]
    q_norm: np.ndarray      # [hd]
    k_norm: np.ndarray      # [hd]
    post_norm: np.ndarray   # [hidden]: Qwen3's post_attention_layernorm, Apertus' feedforward_layernorm
    mlp: GatedSiluMLP | XieluMLP


def decoder_layer(config: ModelConfig, w: dict[str, np.ndarray], p: str, mlp: type = GatedSiluMLP) -> _Layer:
    """One layer's float32 weights from `w`, named under the prefix `p` ("model.layers.N.")."""
    attention_norm, mlp_norm = config.norm_names
    return _Layer(
        input_norm=w[p + attention_norm + ".weight"],
        q_proj=w[p + "self_attn.q_proj.weight"], k_proj=w[p + "self_attn.k_proj.weight"],
        v_proj=w[p + "self_attn.v_proj.weight"], o_proj=w[p + "self_attn.o_proj.weight"],
        q_norm=w[p + "self_attn.q_norm.weight"], k_norm=w[p + "self_attn.k_norm.weight"],
        post_norm=w[p + mlp_norm + ".weight"],
        mlp=mlp.from_weights(w, p + "mlp."),
    )


def as_float32(name: str, array: object, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind in "biuc" or array.dtype == np.object_:
        raise ValueError(f"weight {name!r} has dtype {array.dtype}; expected a floating-point dtype")
    if array.shape != shape and not (is_scalar(shape) and is_scalar(array.shape)):
        raise ValueError(f"weight {name!r} has shape {array.shape}; the config expects {shape}")
    return np.ascontiguousarray(array, dtype=np.float32).reshape(shape)


class ReferenceModel:
    """Qwen3 or Apertus in float32 numpy. `forward` returns logits for every given token."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        shapes = weight_shapes(config)
        missing = [name for name in shapes if name not in weights]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(f"weights lack {', '.join(map(repr, missing[:3]))}{more}; "
                             f"is this a checkpoint of a different model or size?")
        w = {name: as_float32(name, weights[name], shape) for name, shape in shapes.items()}
        self.config = config
        self.embed = w["model.embed_tokens.weight"]  # [vocab, hidden]
        self.norm = w["model.norm.weight"]           # [hidden]
        # Tied models reuse the embedding as the LM head, as transformers does.
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]  # [vocab, hidden]
        mlp = XieluMLP if config.mlp == "xielu" else GatedSiluMLP
        self.layers = [self._layer(config, w, i, mlp) for i in range(config.num_hidden_layers)]
        self.inv_freq = rope_table(config)  # [hd / 2]

    @staticmethod
    def _layer(config: ModelConfig, w: dict[str, np.ndarray], i: int, mlp: type) -> _Layer:
        return decoder_layer(config, w, f"model.layers.{i}.", mlp)

    @classmethod
    def from_checkpoint(cls, ckpt) -> "ReferenceModel":
        """Build from any object with `.config` and `.read(name) -> array` (e.g. model.checkpoint.Checkpoint)."""
        config = ckpt.config
        # Convert tensor by tensor so only one bfloat16 copy is alive at a time.
        weights = {name: as_float32(name, ckpt.read(name), shape)
                   for name, shape in weight_shapes(config).items()}
        return cls(config, weights)

    def new_cache(self, *, int8: bool = False, smoothing: bool = False, parts: str = "kv",
                  bf16: bool = False) -> ReferenceCache:
        """An empty cache; int8 models the INT8 cache, smoothing its key smoothing (kv/int8.py), parts
        which halves are quantized, bf16 the BF16 cache's rounding (ReferenceCache)."""
        from tileinfer.kv.int8 import smoothing_factors
        c = self.config
        factors = [smoothing_factors(layer.k_norm) for layer in self.layers] if int8 and smoothing else None
        return ReferenceCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, int8=int8, smoothing=factors,
                              parts=parts, bf16=bf16)

    # ------------------------------------------------------------------------------------- forward

    def forward(self, token_ids, cache: ReferenceCache | None = None, positions=None, *,
                bf16_activations: bool = False) -> np.ndarray:
        """Logits of every token. # [n, vocab] float32

        With a cache, the tokens' keys and values are appended to it and attention reads everything
        cached; positions default to continuing the cache (0.. without one). bf16_activations rounds
        to bf16 what the engine's kernels write in bf16 (the normed inputs, the q/k/v products, the
        queries after norm, RoPE and smoothing, the attention output, the MLP product, the final
        normed row); the residual stream and the keys and values handed to the cache stay float32, as
        the engine's attn_input quantizes or rounds them from float32.
        """
        ids = self._check_ids(token_ids)
        if cache is None:
            cache = self.new_cache()  # a throwaway cache keeps one code path
        self._check_cache(cache)
        positions = self._check_positions(positions, len(ids), cache.num_positions)
        start = cache.append_positions(positions)
        r = _rounding(bf16_activations)
        try:
            h, _ = self._layers(ids, positions, cache, start, r)
        except BaseException:
            cache.truncate(start)  # a failed forward must not leave half-written entries behind
            raise
        return r(rms_norm(h, self.norm, self.config.rms_norm_eps)) @ self.lm_head.T

    def forward_features(self, token_ids, layer_ids, cache: ReferenceCache | None = None,
                         positions=None) -> tuple[np.ndarray, np.ndarray]:
        """forward's logits [n, vocab] and, from the same pass, the hidden states after the layers in
        layer_ids side by side [n, len(layer_ids) * hidden] (what a DFlash drafter reads; `hidden_rows`)."""
        ids = self._check_ids(token_ids)
        layer_ids = self._check_layer_ids(layer_ids)
        cache = self.new_cache() if cache is None else cache
        self._check_cache(cache)
        positions = self._check_positions(positions, len(ids), cache.num_positions)
        start = cache.append_positions(positions)
        try:
            h, features = self._layers(ids, positions, cache, start, _rounding(False), layer_ids)
        except BaseException:
            cache.truncate(start)
            raise
        return self.head(h), features

    def _layers(self, ids: np.ndarray, positions: np.ndarray, cache, start: int, r,
                capture: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray | None]:
        """The residual stream after the last layer [n, hidden] and the captured layers' outputs (None
        without `capture`)."""
        eps = self.config.rms_norm_eps
        h = self.embed[ids]  # [n, hidden], the residual stream
        taken = {}
        for index, layer in enumerate(self.layers):
            h = h + self._attention_block(layer, r(rms_norm(h, layer.input_norm, eps)), positions, cache, index,
                                          start, r)
            h = h + layer.mlp(r(rms_norm(h, layer.post_norm, eps)), r)
            if index in capture:
                taken[index] = h
        if not capture:
            return h, None
        # transformers' hidden_states[num_layers] is the final-normed state, not the last layer's raw output.
        last = len(self.layers) - 1
        if last in taken:
            taken[last] = rms_norm(h, self.norm, eps)
        return h, np.concatenate([taken[i] for i in capture], axis=1)

    def _attention_block(self, layer: _Layer, x: np.ndarray, positions: np.ndarray,
                         cache: ReferenceCache, index: int, start: int, r) -> np.ndarray:
        c = self.config
        n = x.shape[0]
        q = r(x @ layer.q_proj.T).reshape(n, c.num_attention_heads, c.head_dim)
        k = r(x @ layer.k_proj.T).reshape(n, c.num_key_value_heads, c.head_dim)
        v = r(x @ layer.v_proj.T).reshape(n, c.num_key_value_heads, c.head_dim)
        # Both families normalise each head's q and k before RoPE.
        q = apply_rope(rms_norm(q, layer.q_norm, c.rms_norm_eps), positions, self.inv_freq)
        k = apply_rope(rms_norm(k, layer.k_norm, c.rms_norm_eps), positions, self.inv_freq)
        cache.write(index, start, k, v)
        if cache.smoothing is not None:
            q = q * cache.smoothing[index]  # the cache holds k / c
        keys, values, key_positions = cache.read(index)
        out = r(attention(r(q), keys, values, positions, key_positions))
        return out.reshape(n, c.q_size) @ layer.o_proj.T  # [n, hidden]

    def hidden_rows(self, ids: np.ndarray, positions: np.ndarray, cache,
                    capture: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray | None]:
        """The residual stream after the last layer [n, hidden] of tokens `ids` at `positions`, over any cache with
        `write(layer, start, k, v)`, `read(layer) -> (keys, values, positions)` and `smoothing` (the CPU runner's
        paged numpy cache; the caller has placed the positions in it), and, in the same pass, the outputs
        of the layers in `capture` side by side [n, len(capture) * hidden] (None without). A captured last
        layer gives the final-normed state, as transformers' hidden_states[num_layers] does."""
        return self._layers(np.asarray(ids, np.int64), np.asarray(positions, np.int64), cache, 0, _rounding(False),
                            tuple(capture))

    def head(self, h: np.ndarray) -> np.ndarray:
        """Logits of residual-stream rows: final norm, then the LM head. # [n, vocab]"""
        return rms_norm(h, self.norm, self.config.rms_norm_eps) @ self.lm_head.T

    def greedy(self, prompt_ids, n: int) -> list[int]:
        """The n tokens greedy decoding appends to the prompt (prefill once, then one token a step)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        cache = self.new_cache()
        out: list[int] = []
        logits = self.forward(prompt_ids, cache)
        while len(out) < n:
            out.append(int(np.argmax(logits[-1])))
            if len(out) < n:
                logits = self.forward([out[-1]], cache)
        return out

    def forward_bf16_activations(self, token_ids) -> np.ndarray:
        """The logits of a prompt as an ideal bf16 engine computes them: bf16 activations (forward's
        bf16_activations) and a BF16 cache; positions 0..n-1. To tell that rounding apart from a
        kernel's error."""
        return self.forward(token_ids, self.new_cache(bf16=True), bf16_activations=True)

    # ------------------------------------------------------------------------------------- checks

    def _check_ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary 0..{self.config.vocab_size - 1}")
        return ids.astype(np.int64)

    def _check_cache(self, cache: ReferenceCache) -> None:
        c = self.config
        expected = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        if not isinstance(cache, ReferenceCache) or cache._shape != expected:
            raise ValueError("cache was not made by this model's new_cache() (layers, KV heads or head_dim differ)")

    def _check_layer_ids(self, layer_ids) -> tuple[int, ...]:
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i < self.config.num_hidden_layers]
        if not ids or bad or len(set(ids)) != len(ids):
            raise ValueError(f"layer_ids must be distinct layers in 0..{self.config.num_hidden_layers - 1}, "
                             f"got {list(layer_ids)}")
        return ids

    @staticmethod
    def _check_positions(positions, n: int, cached: int) -> np.ndarray:
        if positions is None:
            return np.arange(cached, cached + n, dtype=np.int64)
        positions = np.asarray(positions)
        if positions.shape != (n,) or positions.dtype.kind not in "iu" or (positions < 0).any():
            raise ValueError(f"positions must be {n} non-negative integers (one per token), "
                             f"got shape {positions.shape} dtype {positions.dtype}")
        return positions.astype(np.int64)
