"""The forward pass of Qwen3 and Apertus as a sequence of kernel launches over persistent workspace buffers.

One call enqueues a whole step on a stream: no allocation, no host synchronisation, only
launches whose arguments are fixed addresses. That is what lets a decode step be captured
once into a CUDA graph and replayed as the sequence grows.

    resolve tokens sampled by the previous step -> embed -> per layer [rmsnorm -> QKV GEMM -> attn_input (q/k norm,
    RoPE, store K/V, quantized for an INT8 cache; a decode step over a long cache does this inside the attention
    launch) -> paged attention -> O GEMM (+= residual) -> rmsnorm -> MLP input GEMM with its activation ->
    down GEMM (+= residual)] -> final rmsnorm (selected rows) -> LM head (float32 logits)

The two families run the same launches. What differs is data, fixed at load time: the MLP's input
product is [gate; up] with the SiLU-mul epilogue (Qwen3) or up alone with the xIELU epilogue and the
layer's four parameters (Apertus; model/weights.py MLP_EPILOGUES), and the RoPE frequency table is
plain or llama3-scaled (model/reference.py rope_table).

The residual stream is float32; activations between kernels are bf16. In steps of 3-32 rows the two
residual products also write the next norm's input and each row's sums of squares, and the product
after the norm scales its rows by 1 / rms: only layer 0's input norm and the final norm launch.

The forward reads a typed StepInputs (model/inputs.py); the runner above owns and fills them.

Tensor parallelism (tp, model/sharding.py): each rank runs these launches over its shard (its heads, KV heads,
intermediate rows and vocabulary rows) and three collectives join them, enqueued on the step's stream like
any launch (so a decode graph holds them):
    embed this rank's vocabulary range (other tokens: zero rows)   -> all-reduce resid
    o_proj, down_proj: rank 0 adds its partial product to resid,
        every other rank writes its own over resid                 -> all-reduce resid (old resid + the sum)
    LM head: this rank's [rows, vocab_part] logits                 -> all-gather, then each rank's real
                                                                      columns copied into [rows, vocab]
No step norms in the residual products' epilogue under tp (they need the summed residual), and no LM head
keys (sampling scans the gathered logits).

Hidden-state capture (`capture`, for a DFlash drafter beside the model, runner/gpu_dflash.py): a captured
layer's down product, which adds the MLP's output into the residual stream, also writes the new residual rows
into that layer's columns of a capture buffer (its epilogue's `capture`, kernels/linear.py): no launch of its
own. A captured last layer is final-normed (transformers' hidden_states[num_layers]) into a bf16 buffer of its
own by an RMSNorm launch. The drafter reads the rows of every position the step computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import kernels as K
from ..cuda import DeviceArray, get_device
from ..cuda.memory import copy_columns
from ..kernels.routing import SWAP_BK, SWAP_DEFAULT_ROWS, head_key_count, norm_tiles
from ..kv import PagedKVCache
from .inputs import StepInputs, StepShape
from .reference import rope_table
from .sharding import TensorParallel
from .weights import MLP_EPILOGUES, DeviceWeights

BF16 = np.dtype(ml_dtypes.bfloat16)


def check_supported(config, source) -> None:
    """Refuse, before the GPU is touched, a model this forward would compute wrongly: the attention kernels
    take head_dim 128 only. `source` names the checkpoint."""
    if config.head_dim != 128:
        raise ValueError(f"{source}: head_dim {config.head_dim} is not supported (the kernels need 128)")


@dataclass(frozen=True, slots=True)
class Capture:
    """Where a step leaves the hidden states after `layers` (in that order): a layer's residual rows in
    `states` [max_tokens, len(layers) x hidden] float32 at its column block; the last layer's, final-normed,
    in `last` [max_tokens, hidden] bf16 (None when the last layer is not captured; its column block of
    `states` is then unused)."""
    layers: tuple[int, ...]
    states: DeviceArray
    last: DeviceArray | None

    def free(self) -> None:
        self.states.free()
        if self.last is not None:
            self.last.free()


class Workspace:
    """Activation buffers for steps of up to `max_tokens` rows and `max_logit_rows` logits rows. Under tensor
    parallelism `config` is the rank's (its shards' shapes) and the logits are the whole vocabulary's."""

    def __init__(self, config, max_tokens: int, max_logit_rows: int, max_splits: int, max_partial_rows: int,
                 tp: TensorParallel | None = None):
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
        # Split-K attention partials (decode and verify steps): splits x rows of them, at most max_partial_rows.
        self.max_partial_rows = P = max(1, max_partial_rows)
        self.part_o = DeviceArray((P, c.num_attention_heads, c.head_dim), np.float32)
        self.part_ml = DeviceArray((P, c.num_attention_heads, 2), np.float32)
        self.inv_freq = DeviceArray.from_host(rope_table(c).astype(np.float32))  # [head_dim / 2], llama3-scaled or not
        # The residual products' per-tile sums of squares for the norm after them (before the MLP, before the
        # next layer's attention), in steps of at most EPI_NORM_MAX_ROWS rows.
        ss_shape = (EPI_NORM_MAX_ROWS, norm_tiles(c.hidden_size))
        self.ss_post, self.ss_input = DeviceArray(ss_shape, np.float32), DeviceArray(ss_shape, np.float32)
        # The MLP's flow at 3-64 rows (kernels.mlp_flow): the up product's count of each chunk of act it has
        # written, and the down product's count of its finished blocks; zero between steps.
        self.flow_flags = DeviceArray.zeros((-(-c.intermediate_size // SWAP_BK) + 1,), np.int32)
        self.arrays = [self.resid, self.x, self.qkv, self.q, self.attn, self.act, self.final_x, self.part_o,
                       self.part_ml, self.inv_freq, self.ss_post, self.ss_input, self.flow_flags]
        self._logit_buffers(c, max_logit_rows, tp)

    def _logit_buffers(self, c, rows: int, tp: TensorParallel | None) -> None:
        """Float32 logits of the whole vocabulary and each row's argmax; on one GPU also the batch-1 LM head's
        keys, under tensor parallelism this rank's logits part and every rank's, gathered."""
        vocab = c.vocab_size if tp is None else tp.vocab_size
        self.logits = DeviceArray((rows, vocab), np.float32)
        self.logit_argmax = DeviceArray((rows,), np.int32)  # each logits row's argmax, when asked
        self.head_keys = self.logits_part = self.logits_parts = None
        if tp is None:
            # The batch-1 LM head's per-block keys of its largest logit (linear(head_keys=), for sample()).
            self.head_keys = DeviceArray((head_key_count(c.vocab_size, c.hidden_size),), np.uint64)
            self.arrays += [self.logits, self.logit_argmax, self.head_keys]
            return
        self.logits_part = DeviceArray((rows, tp.vocab_per), np.float32)               # [rows, vocab_part]
        self.logits_parts = DeviceArray((tp.world * rows, tp.vocab_per), np.float32)  # [world x rows, vocab_part]
        self.arrays += [self.logits, self.logit_argmax, self.logits_part, self.logits_parts]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def free(self) -> None:
        for a in self.arrays:
            a.free()


@dataclass(frozen=True, slots=True)
class _Views:
    """One step's rows of the workspace and inputs, and how its products run."""
    n: int
    b: int
    resid: DeviceArray
    x: DeviceArray
    qkv: DeviceArray
    q: DeviceArray
    attn: DeviceArray
    act: DeviceArray
    positions: DeviceArray
    slots: DeviceArray
    partials: tuple | None
    epi_norm: bool              # the residual products write the next norm's input and row statistics
    flow_flags: DeviceArray | None  # the MLP's two products as gemm_swap.cu's flow builds (3-64 rows), their counts
    ss_post: DeviceArray | None
    ss_input: DeviceArray | None
    force: str | None           # "gemm" in batch-invariant mode: every product on the tensor-core GEMM
    fuse_input: bool            # the attention launch does attn_input's work
    inv_freq: DeviceArray       # [head_dim / 2] float32 RoPE frequencies
    tp: TensorParallel | None   # this rank's place in a tensor-parallel group
    partial: str                # the o_proj and down_proj epilogue: "residual" (resid += product), or "f32"
                                # (resid = product) on a tensor-parallel rank past 0, whose all-reduce adds it


def forward(weights: DeviceWeights, ws: Workspace, cache: PagedKVCache, inputs: StepInputs, shape: StepShape,
            *, all_logits: bool, num_splits: int, stream, batch_invariant: bool = False,
            embedded: bool = False, tp: TensorParallel | None = None, capture: Capture | None = None) -> DeviceArray:
    """Enqueue one step. Returns the logits rows: every token's (all_logits) or each sequence's last.
    embedded: the step's token ids already hold the ones the previous step sampled, and ws.resid their
    embeddings (fetch_step with embed=, a decode step's first kernel; under tp this rank's part of them,
    all-reduced here). tp: this rank's place in a tensor-parallel group (the module docstring); `weights` and
    `cache` hold its shards, `ws` was made with the same tp. capture: also copy the hidden states after
    those layers (the module docstring).

    By default each matrix product picks its kernel by row count and attention its shape by
    query rows; batch_invariant runs every product on the tensor-core GEMM and attention in its
    prefill shape, so a token's results do not depend on the step around it (runner/gpu.py)."""
    if capture is not None and tp is not None:
        raise ValueError("forward: hidden-state capture is for one GPU (a rank's residual is a partial sum)")
    v = _views(weights.config, ws, inputs, shape, num_splits, batch_invariant, tp)
    if not embedded:
        K.resolve_tokens(inputs.tokens.rows(0, v.n), inputs.token_src.rows(0, v.n), inputs.sampled, stream)
        K.embedding(inputs.tokens.rows(0, v.n), weights.embed, v.resid, stream,
                    first=0 if tp is None else tp.vocab_start)
    _all_reduce(v, stream)  # each rank embedded the tokens of its vocabulary range (zero rows elsewhere)
    layers = weights.layers
    c = weights.config
    for i, lw in enumerate(layers):
        _attention_block(c, lw, i, cache, inputs, shape, v, num_splits, batch_invariant, stream)
        _mlp_block(c, lw, layers[i + 1] if i + 1 < len(layers) else None, v, stream,
                   capture=_capture_columns(c, capture, i, v))
    if capture is not None and capture.last is not None:
        K.rmsnorm(v.resid, weights.final_norm, capture.last.rows(0, v.n), c.rms_norm_eps, stream)
    return _lm_head(weights, ws, inputs, v, all_logits, batch_invariant, stream)


def _views(c, ws: Workspace, inputs: StepInputs, shape: StepShape, num_splits: int, batch_invariant: bool,
           tp: TensorParallel | None) -> _Views:
    n, b = shape.num_tokens, shape.num_seqs
    if n > ws.max_tokens:
        raise ValueError(f"step of {n} tokens exceeds the workspace ({ws.max_tokens}); split the prefill into chunks")
    partials = None
    if num_splits > 1:
        if num_splits > ws.max_splits or n * num_splits > ws.max_partial_rows:
            raise ValueError(f"split attention for {n} rows x {num_splits} splits exceeds the workspace")
        partials = (_prefix_view(ws.part_o, (num_splits, n)), _prefix_view(ws.part_ml, (num_splits, n)))
    # Steps of 3-32 rows (on the swap-AB GEMM): o_proj and down_proj also write the next norm's input and row
    # statistics, and the product after the norm scales its rows (no rmsnorm launches but the first layer's
    # and the final one). Not under tp: the norm needs the residual summed over the ranks.
    epi_norm = tp is None and not batch_invariant and n in SWAP_DEFAULT_ROWS and n <= EPI_NORM_MAX_ROWS
    # The MLP's two products as gemm_swap.cu's flow builds (3-64 rows, kernels.mlp_flow), with the norm statistics
    # where those run.
    flow = tp is None and not batch_invariant and K.uses_mlp_flow(n, MLP_EPILOGUES[c.mlp], c.hidden_size,
                                                                  c.intermediate_size, get_device().info.num_sms)
    fuse_input = K.engine_fuses_input(max_q_len=shape.max_q_len, num_heads=c.num_attention_heads,
                                      num_kv_heads=c.num_key_value_heads, num_splits=num_splits, num_seqs=b,
                                      decode_shape=not batch_invariant, rows_share_keys=shape.rows_share_keys)
    return _Views(n=n, b=b, resid=ws.resid.rows(0, n), x=ws.x.rows(0, n), qkv=ws.qkv.rows(0, n), q=ws.q.rows(0, n),
                  attn=ws.attn.rows(0, n), act=ws.act.rows(0, n), positions=inputs.positions.rows(0, n),
                  slots=inputs.slots.rows(0, n), partials=partials, epi_norm=epi_norm,
                  flow_flags=ws.flow_flags if flow else None,
                  ss_post=ws.ss_post.rows(0, n) if epi_norm else None,
                  ss_input=ws.ss_input.rows(0, n) if epi_norm else None,
                  force="gemm" if batch_invariant else None, fuse_input=fuse_input,
                  inv_freq=ws.inv_freq, tp=tp, partial="f32" if tp is not None and tp.rank > 0 else "residual")


def _attention_block(c, lw, i: int, cache: PagedKVCache, inputs: StepInputs, shape: StepShape, v: _Views,
                     num_splits: int, batch_invariant: bool, stream) -> None:
    """resid += o_proj(attention(q/k norm, RoPE, store K/V (norm(resid) @ W_qkv)))."""
    eps = c.rms_norm_eps
    if v.epi_norm and i > 0:  # the previous layer's down product wrote x and its row statistics
        K.linear(v.x, lw.w_qkv, v.qkv, "bf16", stream, row_norm=(v.ss_input, eps))
    else:
        K.norm_linear(v.resid, lw.input_norm, eps, v.x, lw.w_qkv, v.qkv, "bf16", stream, force=v.force)
    scales = cache.layer_scales(i)
    fused = None
    if v.fuse_input:  # the attention launch does attn_input's work (kernels/attention.py engine_fuses_input)
        fused = K.FusedInput(v.qkv, v.positions, v.slots, lw.q_norm, lw.k_norm, v.inv_freq,
                             None if scales is None else cache.layer_smoothing(i), eps)
    elif scales is None:
        K.attn_input(v.qkv, v.positions, v.slots, lw.q_norm, lw.k_norm, v.inv_freq, v.q, cache.k_pool(i),
                     cache.v_pool(i), c.num_attention_heads, c.num_key_value_heads, eps, stream)
    else:
        K.attn_input_int8(v.qkv, v.positions, v.slots, lw.q_norm, lw.k_norm, v.inv_freq, cache.layer_smoothing(i),
                          v.q, cache.k_pool(i), cache.v_pool(i), *scales, c.num_attention_heads,
                          c.num_key_value_heads, eps, stream)
    K.attention(v.q, cache.k_pool(i), cache.v_pool(i), v.attn, inputs.cu_q.rows(0, v.b + 1),
                inputs.kv_lens.rows(0, v.b), inputs.block_tables.rows(0, v.b), max_q_len=shape.max_q_len,
                num_splits=num_splits, partials=v.partials, scales=scales, decode_shape=not batch_invariant,
                fused=fused, stream=stream)
    attn_flat = v.attn.view((v.n, c.q_size))
    if v.epi_norm:
        K.linear(attn_flat, lw.w_o, v.resid, "residual", stream, norm_out=(lw.post_norm, v.x, v.ss_post))
    else:
        K.linear(attn_flat, lw.w_o, v.resid, v.partial, stream, force=v.force)
        _all_reduce(v, stream)


def _mlp_block(c, lw, next_layer, v: _Views, stream, capture: tuple[DeviceArray, int] | None = None) -> None:
    """resid += down(act(norm(resid) @ w_up^T)): silu(gate) * up for Qwen3, xielu(up) for Apertus; with
    epi_norm the down product also writes the next layer's normed input and row statistics (none after the
    last layer). capture: where the down product also writes the new residual rows (linear's capture)."""
    eps = c.rms_norm_eps
    epilogue = MLP_EPILOGUES[c.mlp]
    norm_out = None if next_layer is None else (next_layer.input_norm, v.x, v.ss_input)
    if v.flow_flags is not None and capture is None:  # the down product starts on act's chunks as they are written
        if v.epi_norm:
            K.mlp_flow(v.x, lw.w_up, v.act, lw.w_down, v.resid, epilogue, v.flow_flags, stream, act=lw.act,
                       row_norm=(v.ss_post, eps), norm_out=norm_out)
        else:
            K.rmsnorm(v.resid, lw.post_norm, v.x, eps, stream)
            K.mlp_flow(v.x, lw.w_up, v.act, lw.w_down, v.resid, epilogue, v.flow_flags, stream, act=lw.act)
        return
    if v.epi_norm:
        K.linear(v.x, lw.w_up, v.act, epilogue, stream, row_norm=(v.ss_post, eps), act=lw.act)
        K.linear(v.act, lw.w_down, v.resid, "residual", stream, norm_out=norm_out, capture=capture)
        return
    K.norm_linear(v.resid, lw.post_norm, eps, v.x, lw.w_up, v.act, epilogue, stream, force=v.force, act=lw.act)
    K.linear(v.act, lw.w_down, v.resid, v.partial, stream, force=v.force, capture=capture)
    _all_reduce(v, stream)


def _capture_columns(c, capture: Capture | None, i: int, v: _Views) -> tuple[DeviceArray, int] | None:
    """Where layer i's down product writes its output rows (linear's capture): its column block of
    capture.states, or None (not captured there; the last layer's goes final-normed into capture.last)."""
    if capture is None or i not in capture.layers or i == c.num_hidden_layers - 1:
        return None
    return capture.states.rows(0, v.n), capture.layers.index(i) * c.hidden_size


def _all_reduce(v: _Views, stream) -> None:
    """Under tp: resid (float32 [n, hidden]) summed over the ranks, in place; nothing on one GPU."""
    if v.tp is not None:
        v.tp.comm.all_reduce(v.resid, stream)


def _lm_head(weights: DeviceWeights, ws: Workspace, inputs: StepInputs, v: _Views, all_logits: bool,
             batch_invariant: bool, stream) -> DeviceArray:
    """Final norm of the selected rows (every token's, or each sequence's last), then the LM head in float32."""
    rows = v.n if all_logits else v.b
    if rows > ws.max_logit_rows:
        raise ValueError(f"{rows} logits rows exceed the workspace ({ws.max_logit_rows})")
    final_x, logits = ws.final_x.rows(0, rows), ws.logits.rows(0, rows)
    K.rmsnorm(v.resid, weights.final_norm, final_x, weights.config.rms_norm_eps, stream,
              rows=None if all_logits else inputs.last_rows.rows(0, v.b))
    if v.tp is not None:
        _gathered_logits(weights, ws, final_x, logits, v, stream)
        return logits
    K.linear(final_x, weights.lm_head, logits, "f32", stream, force=v.force,
             head_keys=ws.head_keys if head_keys_written(logits, batch_invariant) else None)
    return logits


def _gathered_logits(weights: DeviceWeights, ws: Workspace, final_x: DeviceArray, logits: DeviceArray, v: _Views,
                     stream) -> None:
    """Under tp: this rank's logits part, every rank's gathered, and each part's real columns (its vocabulary
    range; the zero-padded rows' columns are dropped) copied into logits [rows, vocab]."""
    rows, tp = final_x.shape[0], v.tp
    part = ws.logits_part.rows(0, rows)                # [rows, vocab_part]
    parts = ws.logits_parts.rows(0, tp.world * rows)   # [world x rows, vocab_part], rank-major
    K.linear(final_x, weights.lm_head, part, "f32", stream, force=v.force)
    tp.comm.all_gather(part, parts, stream)
    for r, (start, stop) in enumerate(tp.vocab_ranges()):
        copy_columns(logits, start, parts.rows(r * rows, (r + 1) * rows), 0, stop - start, stream)


# Steps of 3-32 rows take the norm statistics from the residual products' epilogue (gemm_swap.cu) instead of
# launching the rmsnorm kernel before QKV and gate/up. Beyond 32 rows the epilogue's extra writes cost more
# than the launches they save.
EPI_NORM_MAX_ROWS = 32


def head_keys_written(logits: DeviceArray, batch_invariant: bool, tp: TensorParallel | None = None) -> bool:
    """Whether forward() had the LM head write ws.head_keys with these logits (one row, on the GEMV, one GPU)."""
    return tp is None and logits.shape[0] == 1 and not batch_invariant


def _prefix_view(buf: DeviceArray, lead: tuple[int, int]) -> DeviceArray:
    """A [splits, rows, ...] array over the start of `buf` (the kernel indexes it split-major, rows dense)."""
    return DeviceArray((*lead, *buf.shape[1:]), buf.dtype, ptr=buf.ptr, base=buf)
