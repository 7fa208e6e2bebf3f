"""What one forward step reads: its shape and the device arrays of its per-step inputs.

The runner owns the memory (persistent step buffers, tileinfer/runner/step.py) and fills it
before each step; the forward (model/forward.py) only reads these addresses, so a CUDA graph
captured over them stays valid as sequences grow.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cuda import DeviceArray


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the kernels of one step are launched for."""
    num_tokens: int     # rows of the step (sum of the sequences' new tokens, padding included)
    num_seqs: int       # sequences (padding included)
    max_q_len: int      # most new tokens of any one sequence
    # The rows of one request read each other's new keys (a DFlash block pass, runner/step.py token_rows_shape:
    # every block token is a sequence of its own over the request's shared block table). Each layer then stores
    # all new keys and values (attn_input) before attention reads them: an attention launch that stores its own
    # row's key (the fused input) would race with the launch's other blocks reading it.
    rows_share_keys: bool = False


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Device arrays sized for the largest step; a step of n tokens and b sequences reads their first rows."""
    tokens: DeviceArray        # [max_tokens] int32 token ids
    token_src: DeviceArray     # [max_tokens] int32: >= 0 takes the token the previous step sampled in that row
    positions: DeviceArray     # [max_tokens] int32
    slots: DeviceArray         # [max_tokens] int32 flat cache slot (page * page_size + offset), -1: padding
    cu_q: DeviceArray          # [max_seqs + 1] int32 first token row of each sequence
    kv_lens: DeviceArray       # [max_seqs] int32 positions each sequence attends to
    last_rows: DeviceArray     # [max_seqs] int32 row of each sequence's last new token
    block_tables: DeviceArray  # [max_seqs, table_width] int32 page ids
    sampled: DeviceArray       # [max_seqs] int32 the previous sampled step's tokens (token_src reads them)
