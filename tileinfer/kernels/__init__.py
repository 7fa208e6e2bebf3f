"""One launcher module per cuda_src/ kernel family: validate shapes, compute the grid, launch."""
from .attention import FusedInput, attention
from .routing import (DECODE_ITEMS_BLOCKS, FUSED_MIN_SPLITS, bf16_decode_blocks, engine_fuses_input, fuses_input,
                      int8_decode_blocks, keys_mode, uses_mlp_flow)
from .attn_input import attn_input, attn_input_int8
from .embedding import embedding, fetch_step, gather_states, next_block_inputs, resolve_tokens
from .linear import linear, mlp_flow, norm_linear
from .rmsnorm import rmsnorm
from .sampling import argmax, sample

__all__ = ["FusedInput", "attention", "DECODE_ITEMS_BLOCKS", "bf16_decode_blocks", "engine_fuses_input",
           "fuses_input", "int8_decode_blocks", "keys_mode", "FUSED_MIN_SPLITS", "attn_input", "attn_input_int8",
           "embedding", "fetch_step", "gather_states", "next_block_inputs", "resolve_tokens", "linear", "mlp_flow",
           "norm_linear", "rmsnorm", "argmax", "sample", "uses_mlp_flow"]
