"""The Qwen3 forward pass as a sequence of kernel launches over persistent workspace buffers.

One call enqueues a whole step on a stream: no allocation, no host synchronisation, only
launches whose arguments are fixed addresses. That is what lets a decode step be captured
once into a CUDA graph and replayed as the sequence grows.

    resolve tokens sampled by the previous step -> embed -> per layer [rmsnorm -> QKV GEMM -> attn_input (q/k norm, RoPE, store K/V,
    quantized for an INT8 cache; a decode step over a long cache does this inside the attention launch) ->
    paged attention -> O GEMM (+= residual) -> rmsnorm -> gate/up GEMM with SiLU*mul ->
    down GEMM (+= residual)] -> final rmsnorm (selected rows) -> LM head (float32 logits)

The residual stream is float32; activations between kernels are bf16. In steps of 3-32 rows (EPI_NORM)
the two residual products also write the next norm's input and each row's sums of squares, and the
product after the norm scales its rows by 1 / rms: only layer 0's input norm and the final norm launch.
"""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from .. import kernels as K
from ..cuda import DeviceArray
from ..engine.step import StepBuffers, StepShape
from ..kernels.linear import SWAP_DEFAULT_ROWS, head_key_count, norm_tiles
from ..kv import PagedKVCache
from .reference import rope_inv_freq
from .weights import DeviceWeights

BF16 = np.dtype(ml_dtypes.bfloat16)


class Workspace:
    """Activation buffers for steps of up to `max_tokens` rows and `max_logit_rows` logits rows."""

    def __init__(self, config, max_tokens: int, max_logit_rows: int, max_decode_rows: int, max_splits: int,
                 max_partial_rows: int | None = None):
        c = config
        T = max_tokens
        self.max_tokens, self.max_logit_rows, self.max_splits = max_tokens, max_logit_rows, max_splits
        self.resid = DeviceArray((T, c.hidden_size), np.float32)
        self.x = DeviceArray((T, c.hidden_size), BF16)
        self.qkv = DeviceArray((T, c.qkv_size), BF16)
        self.q = DeviceArray((T, c.num_attention_heads, c.head_dim), BF16)
        self.attn = DeviceArray((T, c.num_attention_heads, c.head_dim), BF16)
        self.act = DeviceArray((T, c.intermediate_size), BF16)
        self.final_x = DeviceArray((max_logit_rows, c.hidden_size), BF16)
        self.logits = DeviceArray((max_logit_rows, c.vocab_size), np.float32)
        self.logit_argmax = DeviceArray((max_logit_rows,), np.int32)  # each logits row's argmax, when asked
        # The batch-1 LM head's per-block keys of its largest logit (linear(head_keys=), for sample()).
        self.head_keys = DeviceArray((head_key_count(c.vocab_size, c.hidden_size),), np.uint64)
        self.max_decode_rows = max_decode_rows
        # Split-K decode attention partials: splits x rows of them, at most max_partial_rows together.
        self.max_partial_rows = max_partial_rows or max_splits * max_decode_rows
        P = self.max_partial_rows
        self.part_o = DeviceArray((P, c.num_attention_heads, c.head_dim), np.float32)
        self.part_ml = DeviceArray((P, c.num_attention_heads, 2), np.float32)
        self.inv_freq = DeviceArray.from_host(rope_inv_freq(c.head_dim, c.rope_theta).astype(np.float32))
        # EPI_NORM: the residual products' per-tile sums of squares for the norm after them (before the MLP,
        # before the next layer's attention), at most EPI_NORM_MAX_ROWS rows.
        ss_shape = (EPI_NORM_MAX_ROWS, norm_tiles(c.hidden_size))
        self.ss_post, self.ss_input = DeviceArray(ss_shape, np.float32), DeviceArray(ss_shape, np.float32)
        self.arrays = [self.resid, self.x, self.qkv, self.q, self.attn, self.act, self.final_x, self.logits,
                       self.logit_argmax, self.head_keys, self.part_o, self.part_ml, self.inv_freq, self.ss_post,
                       self.ss_input]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def free(self) -> None:
        for a in self.arrays:
            a.free()


def forward(weights: DeviceWeights, ws: Workspace, cache: PagedKVCache, steps: StepBuffers, shape: StepShape,
            *, all_logits: bool, num_splits: int, stream, batch_invariant: bool = False,
            embedded: bool = False) -> DeviceArray:
    """Enqueue one step. Returns the logits rows: every token's (all_logits) or each sequence's last.
    embedded: the step's token ids already hold the ones the previous step sampled, and ws.resid their
    embeddings (fetch_step with embed=, a decode step's first kernel).

    By default each matrix product picks its kernel by row count and attention its shape by
    query rows; batch_invariant runs every product on the tensor-core GEMM and attention in its
    prefill shape, so a token's results do not depend on the step around it (engine/model.py)."""
    linear_path = "gemm" if batch_invariant else None
    c = weights.config
    n, b = shape.num_tokens, shape.num_seqs
    if n > ws.max_tokens:
        raise ValueError(f"step of {n} tokens exceeds the workspace ({ws.max_tokens}); split the prefill into chunks")
    d = steps.dev
    tokens, positions, slots = d["tokens"].rows(0, n), d["positions"].rows(0, n), d["slots"].rows(0, n)
    cu_q, kv_lens, tables = d["cu_q"].rows(0, b + 1), d["kv_lens"].rows(0, b), d["block_tables"].rows(0, b)
    resid, x = ws.resid.rows(0, n), ws.x.rows(0, n)
    qkv, q, attn, act = ws.qkv.rows(0, n), ws.q.rows(0, n), ws.attn.rows(0, n), ws.act.rows(0, n)
    attn_flat = attn.view((n, c.q_size))
    partials = None
    if num_splits > 1:
        if n > ws.max_decode_rows or num_splits > ws.max_splits or n * num_splits > ws.max_partial_rows:
            raise ValueError(f"split attention for {n} rows x {num_splits} splits exceeds the workspace")
        partials = (_prefix_view(ws.part_o, (num_splits, n)), _prefix_view(ws.part_ml, (num_splits, n)))

    # EPI_NORM (steps of 3-32 rows, on the swap-AB GEMM): o_proj and down_proj also write the next norm's
    # input and row statistics, and the product after the norm scales its rows (no rmsnorm launches but the
    # first layer's and the final one).
    epi_norm = EPI_NORM and not batch_invariant and n in SWAP_DEFAULT_ROWS and n <= EPI_NORM_MAX_ROWS
    eps = c.rms_norm_eps
    ss_post, ss_input = (ws.ss_post.rows(0, n), ws.ss_input.rows(0, n)) if epi_norm else (None, None)
    layers = weights.layers
    fuse_input = K.engine_fuses_input(max_q_len=shape.max_q_len, num_heads=c.num_attention_heads,
                                      num_kv_heads=c.num_key_value_heads, num_splits=num_splits,
                                      decode_shape=not batch_invariant)
    if not embedded:
        K.resolve_tokens(tokens, d["token_src"].rows(0, n), steps.sampled, stream)
        K.embedding(tokens, weights.embed, resid, stream)
    for i, lw in enumerate(layers):
        if epi_norm and i > 0:
            K.linear(x, lw.w_qkv, qkv, "bf16", stream, row_norm=(ss_input, eps))
        else:
            K.norm_linear(resid, lw.input_norm, eps, x, lw.w_qkv, qkv, "bf16", stream, force=linear_path)
        scales = cache.layer_scales(i)
        fused = None
        if fuse_input:  # the attention launch does attn_input's work (kernels/attention.py engine_fuses_input)
            fused = K.FusedInput(qkv, positions, slots, lw.q_norm, lw.k_norm, ws.inv_freq,
                                 None if scales is None else cache.layer_smoothing(i), c.rms_norm_eps)
        elif scales is None:
            K.attn_input(qkv, positions, slots, lw.q_norm, lw.k_norm, ws.inv_freq, q, cache.k_pool(i),
                         cache.v_pool(i), c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps, stream)
        else:
            K.attn_input_int8(qkv, positions, slots, lw.q_norm, lw.k_norm, ws.inv_freq, cache.layer_smoothing(i), q,
                              cache.k_pool(i), cache.v_pool(i), *scales, c.num_attention_heads,
                              c.num_key_value_heads, c.rms_norm_eps, stream)
        K.attention(q, cache.k_pool(i), cache.v_pool(i), attn, cu_q, kv_lens, tables, max_q_len=shape.max_q_len,
                    num_splits=num_splits, partials=partials, scales=scales, decode_shape=not batch_invariant,
                    fused=fused, stream=stream)
        if epi_norm:
            K.linear(attn_flat, lw.w_o, resid, "residual", stream, norm_out=(lw.post_norm, x, ss_post))
            K.linear(x, lw.w_gu, act, "silu_mul", stream, row_norm=(ss_post, eps))
            last = i == len(layers) - 1
            K.linear(act, lw.w_down, resid, "residual", stream,
                     norm_out=None if last else (layers[i + 1].input_norm, x, ss_input))
            continue
        K.linear(attn_flat, lw.w_o, resid, "residual", stream, force=linear_path)
        K.norm_linear(resid, lw.post_norm, eps, x, lw.w_gu, act, "silu_mul", stream, force=linear_path)
        K.linear(act, lw.w_down, resid, "residual", stream, force=linear_path)

    rows = n if all_logits else b
    if rows > ws.max_logit_rows:
        raise ValueError(f"{rows} logits rows exceed the workspace ({ws.max_logit_rows})")
    final_x, logits = ws.final_x.rows(0, rows), ws.logits.rows(0, rows)
    K.rmsnorm(resid, weights.final_norm, final_x, eps, stream,
              rows=None if all_logits else d["last_rows"].rows(0, b))
    K.linear(final_x, weights.lm_head, logits, "f32", stream, force=linear_path,
             head_keys=ws.head_keys if head_keys_written(logits, batch_invariant) else None)
    return logits


# Steps of 3-32 rows take the norm statistics from the residual products' epilogue (gemm_swap.cu) instead
# of launching the rmsnorm kernel before QKV and gate/up. H200, session 14, against the rmsnorm launches:
# qwen3-8b verify (k = 4) 4.81 -> 4.72 ms; qwen3-0.6b batch 4 / 8 / 16 +5.5 / +7.3 / +9.8%, qwen3-4b +3%;
# at batch 64 qwen3-4b lost 1% (0.6b even), hence the 32. TILEINFER_EPI_NORM=0 turns it off (A/B runs).
EPI_NORM = os.environ.get("TILEINFER_EPI_NORM", "1") != "0"
EPI_NORM_MAX_ROWS = 32

# TILEINFER_HEAD_KEYS=0 turns the LM head's keys off (greedy decoding scans the logits again): for A/B runs.
HEAD_KEYS = os.environ.get("TILEINFER_HEAD_KEYS", "1") != "0"


def head_keys_written(logits: DeviceArray, batch_invariant: bool) -> bool:
    """Whether forward() had the LM head write ws.head_keys with these logits (one row, on the GEMV)."""
    return HEAD_KEYS and logits.shape[0] == 1 and not batch_invariant


def _prefix_view(buf: DeviceArray, lead: tuple[int, int]) -> DeviceArray:
    """A [splits, rows, ...] array over the start of `buf` (the kernel indexes it split-major, rows dense)."""
    return DeviceArray((*lead, *buf.shape[1:]), buf.dtype, ptr=buf.ptr, base=buf)
