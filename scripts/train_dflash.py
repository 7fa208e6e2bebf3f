"""Train a DFlash block-diffusion drafter for the demo target with PyTorch; write it as z-lab's drafter directory.

    python scripts/train_dflash.py --target tileinfer/demo/target --data build/demo-data --out build/demo-dflash \
        [--minutes 8] [--check]                          # on a GPU
    python scripts/train_dflash.py --smoke --check     # a tiny run on the CPU, then the checks

PyTorch is this script's tool, never the package's; the script needs tileinfer importable too (its config
classes write config.json; on a GPU machine `source scripts/install_wheels.sh` first). The target is a
scripts/train_demo.py Qwen3 (tied embeddings), loaded from its directory and frozen.

The drafter (z-lab's DFlashDraftModel; tileinfer/model/dflash_reference.py is the definition it is checked
against): a block is the last committed token at position a and block_size - 1 copies of the mask token at
a+1..a+block_size-1, embedded by the target's embedding. The context is the target's hidden states after
`target_layer_ids` (the residual stream; for the target's last layer the final-normed state) at earlier
positions, side by side, through fc then hidden_norm: c. Each drafter layer is Qwen3's, except that its keys
and values come from its k_proj/v_proj over [c; x] (x = input_layernorm of the block), its queries from the
block only, with q_norm/k_norm then RoPE at the target's positions, and no causal mask. Final `norm`, then the
target's LM head: block row j (j >= 1) is the draft of the token AT position a + j.

Training (the published recipe in spirit: z-lab's paper, arXiv 2602.06036, and the open trainers that follow
it): the target runs once per batch of windows of the training stream, without gradients, giving every
position's features and the target's own greedy next token. Several random anchors per window each give a
block; all blocks of a window go through the drafter in one attention call whose boolean mask lets the block
of anchor a see the context entries of positions < a and its own block, nothing else. The labels are the
target's greedy tokens (`make_blocks`), so the drafter learns what the target would emit: acceptance is
agreement with the target's greedy choice. (z-lab train on responses the target generated; greedy labels over
the demo's own text stand in for that at no generation cost. Past row 1 they are the target's choice after
the real text, not after its own earlier choices.) Loss: cross-entropy over block rows 1..block_size-1, row j
weighted exp(-(j - 1) / gamma), the paper's exponential decay in the form the open trainers use: a draft
only counts if every draft before it was accepted, so early rows matter most; gamma 7 for blocks of 16 (the
value given for 16-token blocks; those trainers take 4 for blocks of 8). AdamW, linear warm-up then cosine
decay, gradient clipping, bf16 autocast on CUDA, a fixed seed (batch i and its anchors come from a generator
seeded by (seed, i)). Every TrainSpec.eval_every steps the mean acceptance length of greedy DFlash rounds is
measured on held-out text continued greedily by the target (`evaluate`: exact for greedy decoding, see
`anchored_acceptance` and `round_lengths`), and the weights with the best one are written.

Shapes for the demo target (hidden 384, 8 layers): 2 drafter layers of the target's width (4 query heads and
2 KV heads of 128, intermediate 512): 2.8M parameters, 5.6 MB of bf16, small enough to ship as package data;
block_size 16 as z-lab's drafters; target_layer_ids [1, 3, 5]: three layers at z-lab's spacing from layer 1
to num_target_layers - 3 (`spread_layer_ids`; z-lab reads as many layers as the drafter has, which for 2
layers would be [1, 5]: a third one gives a drafter this shallow more of the target for 0.3 MB).
The mask token is <|fim_pad|> (MASK_TOKEN): an added token of the demo tokenizer that occurs nowhere in the
training or held-out data (checked at start) nor in the chat template (tests/test_train_dflash.py), and that
tool calls and thinking do not use either, as z-lab's drafters use a token id the target never reads as text.

Writes OUT: config.json (DFlashConfig.to_hf_dict: architectures ["DFlashDraftModel"], block_size,
dflash_config {mask_token_id, target_layer_ids}, num_target_layers, layer_types), model.safetensors (bf16;
fc, hidden_norm, layers.N.*, norm: no embedding or LM head, the drafter uses the target's), NOTICE (the data
sources and licences, the mask token) and train-log.jsonl (one JSON object a line: steps' loss, held-out
acceptance, seconds). --check then loads OUT with tileinfer and compares its numpy drafter with this one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts beside this one
import train_demo  # noqa: E402  (the target's PyTorch Qwen3, its layers' pieces, the schedule, the writer)
from train_demo import MLP, RMSNorm, rotate_half  # noqa: E402

from tileinfer.model.checkpoint import dflash_tensors  # noqa: E402
from tileinfer.model.config import Qwen3Config, read_config  # noqa: E402
from tileinfer.model.dflash_config import DFlashConfig  # noqa: E402

MASK_TOKEN = "<|fim_pad|>"      # see the module docstring; the id is looked up in the target's tokenizer.json
WRITE_MARGIN_S = 20             # time kept back from --minutes for the last evaluation and writing


@dataclass(slots=True, frozen=True)
class DrafterShape:
    """What the drafter adds to its target's shape (hidden size, head_dim, vocabulary, RoPE: the target's)."""
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    block_size: int = 16
    target_layers_read: int = 3


@dataclass(slots=True, frozen=True)
class TrainSpec:
    steps: int                  # the schedule's length (--minutes may cut it)
    lr: float
    batch: int                  # windows per step
    seq: int                    # tokens per window
    anchors: int                # blocks per window
    warmup: int
    eval_every: int
    log_every: int
    eval_prompts: int           # held-out prompts per source
    eval_prompt_tokens: int
    eval_new_tokens: int        # greedy tokens generated after each prompt, over which rounds are measured
    loss_gamma: float = 7.0     # row j's loss weight exp(-(j - 1) / gamma)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1


# The demo's: 64 blocks per window of 512 (1,024 drafter rows for 512 target positions: blocks are cheaper than
# the target pass that feeds them, and z-lab's recipe samples hundreds of anchors a sequence); 9,000 steps
# (18.4M blocks, some 23 passes over the training text) at about 32 steps a second on one H200.
DEMO = (DrafterShape(layers=2, heads=4, kv_heads=2, intermediate=512),
        TrainSpec(steps=9000, lr=2e-3, batch=32, seq=512, anchors=64, warmup=100, eval_every=500, log_every=100,
                  eval_prompts=64, eval_prompt_tokens=128, eval_new_tokens=128))
SMOKE = (DrafterShape(layers=1, heads=2, kv_heads=1, intermediate=128),
         TrainSpec(steps=30, lr=3e-3, batch=4, seq=128, anchors=8, warmup=5, eval_every=15, log_every=5,
                   eval_prompts=2, eval_prompt_tokens=32, eval_new_tokens=40))


def spread_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layers evenly spread from layer 1 to num_target_layers - 3, rounded, as z-lab's
    drafters choose them (the middle layer when count is 1). [1, 3, 5] for 3 of 8 layers."""
    if count == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(int(round(first + i * (last - first) / (count - 1))) for i in range(count))


def drafter_config(target: Qwen3Config, shape: DrafterShape, mask_token_id: int) -> DFlashConfig:
    """The DFlashConfig of a drafter of `shape` for `target`: its layers have the target's width, head_dim,
    vocabulary, norms' eps and RoPE."""
    decoder = dataclasses.replace(target, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                                  num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate,
                                  tie_word_embeddings=False)  # it has no embedding of its own to tie
    ids = spread_layer_ids(target.num_hidden_layers, shape.target_layers_read)
    return DFlashConfig(decoder=decoder, block_size=shape.block_size, mask_token_id=mask_token_id,
                        target_layer_ids=ids, num_target_layers=target.num_hidden_layers)


# ---------------------------------------------------------------------------------------------- drafter


def rope_at(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin at any positions [...] -> [..., head_dim], channel i paired with i + head_dim/2; the angle is
    a float32 product, as tileinfer's apply_rope takes it."""
    angle = positions.float()[..., None] * inv_freq
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos(), angle.sin()


class DrafterAttention(nn.Module):
    """Queries from the block; keys and values from the context entries and the block; no causal mask."""

    def __init__(self, d: Qwen3Config):
        super().__init__()
        self.d = d
        self.q_proj = nn.Linear(d.hidden_size, d.q_size, bias=False)
        self.k_proj = nn.Linear(d.hidden_size, d.kv_size, bias=False)
        self.v_proj = nn.Linear(d.hidden_size, d.kv_size, bias=False)
        self.o_proj = nn.Linear(d.q_size, d.hidden_size, bias=False)
        self.q_norm = RMSNorm(d.head_dim)
        self.k_norm = RMSNorm(d.head_dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope_q, rope_kv, visible: torch.Tensor | None) -> torch.Tensor:
        """x [b, n, hidden] (the normed block), c [b, m, hidden] (the context) -> [b, n, hidden]."""
        d, (b, n, _), m = self.d, x.shape, c.shape[1]
        both = torch.cat([c, x], dim=1)                              # context entries first, then the block
        q = self.q_norm(self.q_proj(x).view(b, n, d.num_attention_heads, d.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(b, m + n, d.num_key_value_heads, d.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(b, m + n, d.num_key_value_heads, d.head_dim).transpose(1, 2)
        (cos_q, sin_q), (cos_kv, sin_kv) = rope_q, rope_kv           # [b, n or m + n, head_dim]
        q = q * cos_q[:, None].to(q.dtype) + rotate_half(q) * sin_q[:, None].to(q.dtype)
        k = k * cos_kv[:, None].to(k.dtype) + rotate_half(k) * sin_kv[:, None].to(k.dtype)
        group = d.num_attention_heads // d.num_key_value_heads      # query head h reads KV head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = None if visible is None else visible[:, None]         # True: the key takes part
        # Under autocast the norms hand back float32 (their weights are float32), v is bf16.
        out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d.q_size))


class DrafterLayer(nn.Module):
    def __init__(self, d: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size)
        self.self_attn = DrafterAttention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size)
        self.mlp = MLP(train_demo.ModelSpec(hidden=d.hidden_size, layers=d.num_hidden_layers,
                                            heads=d.num_attention_heads, kv_heads=d.num_key_value_heads,
                                            intermediate=d.intermediate_size, vocab=d.vocab_size,
                                            head_dim=d.head_dim))

    def forward(self, h, c, rope_q, rope_kv, visible):
        h = h + self.self_attn(self.input_layernorm(h), c, rope_q, rope_kv, visible)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """z-lab's DFlashDraftModel; parameter names are its checkpoints' (checkpoint.dflash_tensors)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        d = config.decoder
        if d.rms_norm_eps != train_demo.RMS_EPS:
            raise ValueError(f"rms_norm_eps {d.rms_norm_eps}: train_demo's RMSNorm has {train_demo.RMS_EPS}")
        self.config = config
        self.fc = nn.Linear(config.feature_size, d.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(d.hidden_size)
        self.layers = nn.ModuleList(DrafterLayer(d) for _ in range(d.num_hidden_layers))
        self.norm = RMSNorm(d.hidden_size)
        inv_freq = 1.0 / d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.float64) / d.head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # train_demo's initialisation: norms 1, linears N(0, 0.02), the residual stream's writers shrunk.
        for name, p in self.named_parameters():
            if not name.endswith("norm.weight"):
                writer = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * d.num_hidden_layers) if writer else 0.02)

    def forward(self, features: torch.Tensor, context_positions: torch.Tensor, block_embeds: torch.Tensor,
                block_positions: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden state of every block row [b, n, hidden] (the target's LM head makes them
        logits). features [b, m, feature_size] at context_positions [b, m] (m may be 0); block_embeds [b, n,
        hidden], the target's embedding of the block tokens at block_positions [b, n]; visible [b, n, m + n]
        says which entries (context, then block) each row reads (None: all of them, as at inference)."""
        c = self.hidden_norm(self.fc(features))
        rope_q = rope_at(block_positions, self.inv_freq)
        rope_kv = rope_at(torch.cat([context_positions, block_positions], dim=1), self.inv_freq)
        h = block_embeds
        for layer in self.layers:
            h = layer(h, c, rope_q, rope_kv, visible)
        return self.norm(h)


def num_parameters(config: DFlashConfig) -> int:
    return sum(math.prod(shape) for shape in dflash_tensors(config).values())


# ---------------------------------------------------------------------------------------------- target


def load_target(directory: Path, device) -> train_demo.Qwen3:
    """The frozen target: train_demo's Qwen3 from its written directory, float32 weights."""
    target = train_demo.load_written(directory).to(device)
    target.requires_grad_(False)
    return target


@torch.no_grad()
def target_pass(target: train_demo.Qwen3, ids: torch.Tensor, layer_ids, autocast: bool
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The target over ids [b, t] at positions 0..t-1: (the hidden states after layer_ids side by side
    [b, t, len(layer_ids) * hidden], None without layer_ids; the target's greedy next token at every
    position [b, t]). A layer's
    state is the residual stream after it; the last layer's is the final-normed one, as transformers'
    hidden_states[id + 1] (and ReferenceModel.forward_features) give it."""
    m = target.spec
    cos, sin = train_demo.rope_tables(ids.shape[1], m.head_dim, ids.device)
    last = m.layers - 1
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        h = target.model.embed_tokens(ids)
        taken = {}
        for index, layer in enumerate(target.model.layers):
            h = layer(h, cos, sin)
            if index in layer_ids:
                taken[index] = h
        normed = target.model.norm(h)
        if last in taken:
            taken[last] = normed
        greedy = F.linear(normed, target.model.embed_tokens.weight).argmax(dim=-1)
    return (torch.cat([taken[i] for i in layer_ids], dim=-1) if layer_ids else None), greedy


@torch.no_grad()
def greedy_continue(target: train_demo.Qwen3, prompts: torch.Tensor, n: int, autocast: bool) -> torch.Tensor:
    """prompts [b, p] followed by the target's n greedy tokens [b, p + n] (a full forward a token: the
    target is small and this runs once)."""
    seq = prompts
    for _ in range(n):
        _, greedy = target_pass(target, seq, (), autocast)
        seq = torch.cat([seq, greedy[:, -1:]], dim=1)
    return seq


# ---------------------------------------------------------------------------------------------- blocks


@dataclass
class Blocks:
    """The drafter's input and labels for `anchors` blocks per window. For A anchors of block size B:
    ids [w, A*B] (block i is rows i*B..i*B+B-1: the window's token at anchor a_i, then B-1 mask tokens),
    positions [w, A*B] (a_i .. a_i + B - 1), labels [w, A, B-1] and visible [w, A*B, t + A*B]."""
    ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    visible: torch.Tensor


def make_blocks(tokens: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, block_size: int,
                mask_token_id: int) -> Blocks:
    """Blocks for windows tokens [w, t] whose context entries are positions 0..t-1 (the target's features
    of the window), with greedy [w, t] the target's argmax at each position, anchors [w, A] in 1..t-B+1.

    Labels, and their off-by-one: block row j (1 <= j <= B-1) sits at position a + j and drafts the token
    AT a + j. What the target would emit there is its argmax over the logits at position a + j - 1 (the
    logits at a position predict the next one), so label[j] = greedy[a + j - 1]: row 1's label is greedy[a],
    the target's choice after the anchor token. Row 0 (the anchor token itself) has no label.

    Visibility: block i's rows read the context entries at positions < a_i (what the target has verified
    before a DFlash round anchored at a_i) and every row of block i (no causal mask), nothing of the other
    blocks."""
    w, t = tokens.shape
    num = anchors.shape[1]
    offsets = torch.arange(block_size, device=tokens.device)
    ids = torch.full((w, num, block_size), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    ids[:, :, 0] = torch.gather(tokens, 1, anchors)
    positions = anchors[:, :, None] + offsets                                       # [w, A, B]
    label_positions = anchors[:, :, None] + offsets[:-1]                            # a + j - 1 for j = 1..B-1
    labels = torch.gather(greedy, 1, label_positions.flatten(1)).view(w, num, block_size - 1)
    row_anchor = anchors.repeat_interleave(block_size, dim=1)                       # [w, A*B]
    context = torch.arange(t, device=tokens.device)[None, None, :] < row_anchor[:, :, None]
    block_of = torch.arange(num * block_size, device=tokens.device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(w, -1, -1)
    return Blocks(ids.flatten(1), positions.flatten(1), labels, torch.cat([context, own_block], dim=2))


def sample_anchors(rng: np.random.Generator, windows: int, seq: int, count: int, block_size: int) -> np.ndarray:
    """`count` distinct anchors per window, sorted, in 1..seq-block_size+1: every block has at least one
    context entry and all its labels inside the window. # [windows, count]"""
    choices = seq - block_size + 1
    if count > choices:
        raise ValueError(f"{count} anchors do not fit a window of {seq} tokens with blocks of {block_size}")
    return np.sort(rng.random((windows, choices)).argsort(axis=1)[:, :count] + 1, axis=1)


def loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Rows 1..B-1's loss weights exp(-(j - 1) / gamma): 1 for the first draft. # [B - 1]"""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32, device=device) / gamma)


def block_logits(drafter: DFlashDrafter, embed: torch.Tensor, features: torch.Tensor, blocks: Blocks,
                 autocast: bool) -> torch.Tensor:
    """The logits of every block's rows 1..B-1 [w, A, B-1, vocab] over the windows' context entries
    (positions 0..t-1); embed is the target's embedding, its LM head too (tied)."""
    w, t, _ = features.shape
    b = drafter.config.block_size
    context_positions = torch.arange(t, device=features.device).expand(w, t)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        h = drafter(features, context_positions, F.embedding(blocks.ids, embed), blocks.positions, blocks.visible)
        return F.linear(h.view(w, -1, b, h.shape[-1])[:, :, 1:], embed)


def batch_loss(drafter: DFlashDrafter, target, windows: torch.Tensor, anchors: torch.Tensor,
               weights: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor, Blocks]:
    """One training batch: the target over windows [w, t] (no gradient), the blocks at anchors [w, A], the
    drafter's logits; (the weighted cross-entropy, mean over blocks, the logits, the blocks)."""
    config = drafter.config
    features, greedy = target_pass(target, windows, config.target_layer_ids, autocast)
    blocks = make_blocks(windows, greedy, anchors, config.block_size, config.mask_token_id)
    logits = block_logits(drafter, target.model.embed_tokens.weight, features, blocks, autocast)
    ce = F.cross_entropy(logits.float().flatten(0, 2), blocks.labels.flatten(), reduction="none")
    loss = (ce.view_as(blocks.labels) * weights).sum() / (weights.sum() * blocks.labels[..., 0].numel())
    return loss, logits, blocks


def acceptance(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each block's acceptance length: 1 + the drafts accepted before the first that differs from its
    label (the target's token), as a DFlash round counts it. logits [..., B-1, vocab] -> [...]"""
    return (logits.argmax(dim=-1) == labels).int().cumprod(dim=-1).sum(dim=-1) + 1


# ---------------------------------------------------------------------------------------------- evaluation


def round_lengths(accepted: list[int] | np.ndarray) -> list[int]:
    """The acceptance lengths of successive greedy DFlash rounds, from the acceptance length of a round
    anchored at every position of a greedy continuation (accepted[i]: the round whose last committed token
    is the continuation's i-th): the first round is anchored at the first generated token, each next one at
    the last token the previous one committed. Stops where a round would not have a whole block."""
    lengths, i = [], 0
    while i < len(accepted):
        lengths.append(int(accepted[i]))
        i += int(accepted[i])
    return lengths


@dataclass
class HeldOut:
    """One held-out source's evaluation text: prompts of real text, each followed by the target's greedy
    continuation (sequences [e, p + n]), and the target's features over them."""
    prompt_tokens: int
    sequences: torch.Tensor
    features: torch.Tensor


def prepare_held_out(target, streams: dict[str, torch.Tensor], t: TrainSpec, layer_ids, autocast: bool
                     ) -> dict[str, HeldOut]:
    """t.eval_prompts prompts spread evenly over each held-out stream, continued greedily by the target."""
    out = {}
    for name, stream in streams.items():
        starts = np.linspace(0, len(stream) - t.eval_prompt_tokens - 1, t.eval_prompts).astype(np.int64)
        prompts = torch.stack([stream[s:s + t.eval_prompt_tokens] for s in starts])
        sequences = greedy_continue(target, prompts, t.eval_new_tokens, autocast)
        features, _ = target_pass(target, sequences, layer_ids, autocast)
        out[name] = HeldOut(t.eval_prompt_tokens, sequences, features)
    return out


@torch.no_grad()
def anchored_acceptance(drafter: DFlashDrafter, embed: torch.Tensor, held: HeldOut, autocast: bool,
                        chunk: int = 8) -> torch.Tensor:
    """The acceptance length of a round anchored at each generated position with a whole block left
    [e, n - B + 1]. In a greedy continuation every token is the target's argmax after the ones before it,
    so a round anchored at a accepts exactly the drafts that equal the continuation's tokens: the labels
    are the next tokens."""
    e, length = held.sequences.shape
    b, mask = drafter.config.block_size, drafter.config.mask_token_id
    anchors = torch.arange(held.prompt_tokens, length - b + 1, device=held.sequences.device).expand(e, -1)
    following = torch.cat([held.sequences[:, 1:], held.sequences[:, -1:]], dim=1)  # the last is never read
    out = []
    for i in range(0, e, chunk):
        part = slice(i, i + chunk)
        blocks = make_blocks(held.sequences[part], following[part], anchors[part], b, mask)
        out.append(acceptance(block_logits(drafter, embed, held.features[part], blocks, autocast), blocks.labels))
    return torch.cat(out)


def evaluate(drafter: DFlashDrafter, embed: torch.Tensor, held_out: dict[str, HeldOut], autocast: bool
             ) -> dict[str, float]:
    """Mean acceptance length (tokens a target step commits) of greedy DFlash rounds over each source's
    held-out continuations, and the mean of the sources."""
    drafter.eval()
    result = {}
    for name, held in held_out.items():
        rows = anchored_acceptance(drafter, embed, held, autocast).cpu().numpy()
        lengths = [length for row in rows for length in round_lengths(row)]
        result[name] = float(np.mean(lengths))
    drafter.train()
    result["mean"] = float(np.mean(list(result.values())))
    return result


# ---------------------------------------------------------------------------------------------- training


def train(drafter: DFlashDrafter, target, tokens: train_demo.Tokens, t: TrainSpec, args, deadline: float, log
          ) -> tuple[dict, int, dict]:
    """The schedule, cut at `deadline`: (the best state dict on the CPU, its step, its held-out acceptance)."""
    config = drafter.config
    device = tokens.train.device
    autocast = device.type == "cuda"
    embed = target.model.embed_tokens.weight
    held_out = prepare_held_out(target, tokens.held_out, t, config.target_layer_ids, autocast)
    weights = loss_weights(config.block_size, t.loss_gamma, device)
    optimizer = train_demo.make_optimizer(drafter, t, fused=autocast)
    best = {"mean": -math.inf}
    best_state, best_step = None, -1
    timer, timed_steps, step = time.perf_counter(), 0, 0
    drafter.train()
    while step < t.steps and (step == 0 or time.time() < deadline):   # one step at least: weights to write
        lr = train_demo.learning_rate(step, t.steps, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        rng = np.random.default_rng([args.seed, step])
        starts = torch.from_numpy(rng.integers(0, len(tokens.train) - t.seq, t.batch)).to(device)
        windows = tokens.train[starts[:, None] + torch.arange(t.seq, device=device)]
        anchors = torch.from_numpy(sample_anchors(rng, t.batch, t.seq, t.anchors, config.block_size)).to(device)
        loss, logits, blocks = batch_loss(drafter, target, windows, anchors, weights, autocast)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        step += 1
        timed_steps += 1
        last = step == t.steps
        if step % t.log_every == 0 or last:
            seconds = time.perf_counter() - timer
            rate = timed_steps / seconds
            projection = {"schedule_minutes": round(t.steps / rate / 60, 1)} if step == t.log_every else {}
            log(step=step, of=t.steps, loss=round(loss.item(), 4), lr=float(f"{lr:.3g}"),
                grad_norm=round(norm.item(), 3),
                train_acceptance=round(acceptance(logits.detach(), blocks.labels).float().mean().item(), 3),
                steps_per_s=round(rate, 2), **projection)
            timer, timed_steps = time.perf_counter(), 0
        if step % t.eval_every == 0 or last or time.time() >= deadline:
            result = evaluate(drafter, embed, held_out, autocast)
            if result["mean"] > best["mean"]:
                best, best_step = result, step
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()}
            log(step=step, held_out_acceptance={k: round(v, 3) for k, v in result.items()}, best_step=best_step)
            timer = time.perf_counter()                     # steps_per_s counts training steps only
    if step < t.steps:
        log(cut_at_step=step, of=t.steps, reason="--minutes reached")
    return best_state, best_step, best


# ---------------------------------------------------------------------------------------------- writing


def notice(data_notice: str, mask_token_id: int) -> str:
    """The drafter's NOTICE: what it is, its mask token, then the data's sources and licences."""
    return (f"This DFlash drafter for the demo target (tileinfer/demo/target) was trained by "
            f"scripts/train_dflash.py on the demo models' data, with the target's own greedy predictions as "
            f"labels. Its mask token is {MASK_TOKEN} (id {mask_token_id}): an added token of the demo tokenizer "
            f"that occurs nowhere in that data nor in the chat template's output, so the target never reads it "
            f"as text.\n\n" + data_notice)


def write_drafter(state: dict[str, torch.Tensor], config: DFlashConfig, out: Path, notice_text: str | None = None
                  ) -> int:
    """model.safetensors (bf16), config.json and, when given, NOTICE: the files of a DFlash drafter's directory
    (as tileinfer's synthetic writer and z-lab's checkpoints have them). Returns the bytes of weights."""
    expected = dflash_tensors(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    if shapes != expected:
        raise ValueError(f"the state's tensors {sorted(set(shapes) ^ set(expected)) or 'shapes'} differ from "
                         f"a DFlash drafter's")
    out.mkdir(parents=True, exist_ok=True)
    nbytes = train_demo.write_weights(state, out)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    if notice_text is not None:
        (out / "NOTICE").write_text(notice_text)
    return nbytes


def load_drafter(directory: Path) -> DFlashDrafter:
    """The torch drafter of a written directory, its bf16 weights in float32."""
    from safetensors.torch import load_file

    drafter = DFlashDrafter(DFlashConfig.from_json(directory))
    state = {}
    for file in sorted(directory.glob("model*.safetensors")):
        state.update(load_file(str(file)))
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    return drafter.eval()


def mask_token_id(target_dir: Path) -> int:
    """MASK_TOKEN's id in the target's tokenizer.json."""
    added = json.loads((target_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = [token["id"] for token in added if token["content"] == MASK_TOKEN]
    if not ids:
        raise SystemExit(f"{target_dir}/tokenizer.json has no {MASK_TOKEN}")
    return ids[0]


# ---------------------------------------------------------------------------------------------- check


def check(out: Path, target_dir: Path, streams: dict[str, torch.Tensor], t: TrainSpec, seed: int) -> None:
    """OUT loaded by tileinfer against this script's drafter, both float32 from the written bf16 weights:
    the logits of random contexts and blocks, then dflash_greedy's rounds on two held-out prompts against
    `round_lengths` over the same continuation. Exits 1 on a mismatch."""
    from tileinfer.model.checkpoint import Checkpoint
    from tileinfer.model.dflash_reference import DFlashReference
    from tileinfer.model.reference import ReferenceModel

    reference_target = ReferenceModel.from_checkpoint(Checkpoint.open(target_dir))
    reference = DFlashReference.from_checkpoint(Checkpoint.open_draft(out))
    reference.bind_target(reference_target)
    config = reference.config
    drafter, target = load_drafter(out), load_target(target_dir, "cpu")
    embed = target.model.embed_tokens.weight
    b = config.block_size
    text = next(iter(streams.values()))[:t.eval_prompt_tokens + t.eval_new_tokens].numpy()
    _, features = reference_target.forward_features(text, config.target_layer_ids)
    rng = np.random.default_rng(seed)
    worst = 0.0
    for case in range(4):
        start = int(rng.integers(b, len(text) - b))
        # Contiguous context, none, then random subsets (the RoPE positions of the context are not contiguous).
        m = [start, 0, int(rng.integers(1, start)), int(rng.integers(1, start))][case]
        context = np.sort(rng.choice(start, m, replace=False)) if case > 0 else np.arange(start)
        block = reference.block(int(text[start]), b - 1)
        cache = reference.new_cache()
        entry = cache.append_positions(np.concatenate([context, start + np.arange(b)]))
        expected = reference.forward(features[context], context, block, start, cache, entry)
        with torch.no_grad():
            h = drafter(torch.from_numpy(features[context])[None], torch.from_numpy(context)[None],
                        F.embedding(torch.tensor([block]), embed), torch.arange(start, start + b)[None])
            ours = F.linear(h[0, 1:], embed).numpy()
        error = float(np.abs(ours - expected).max() / np.abs(expected).max())
        worst = max(worst, error)
        print(f"check logits: block at {start} over {m} context entries: max |torch - tileinfer| / max |logit| = "
              f"{error:.1e}")
    if worst > 2e-3:
        print(f"check logits: MISMATCH ({worst:.1e} > 2e-3)")
        raise SystemExit(1)
    agreed = True
    for name, stream in streams.items():
        n = t.eval_new_tokens
        numpy_lengths, torch_lengths, same = compare_rounds(reference_target, reference, target, drafter,
                                                            stream[:t.eval_prompt_tokens].numpy(), n)
        agreed &= same
        print(f"check rounds ({name}, {n} tokens): tileinfer dflash_greedy {numpy_lengths} (mean "
              f"{np.mean(numpy_lengths):.2f}); torch over the same continuation {torch_lengths} (mean "
              f"{np.mean(torch_lengths):.2f}): {'same' if same else 'DIFFERENT'} whole-block rounds")
    if not agreed:
        raise SystemExit(1)


def compare_rounds(reference_target, reference, target, drafter: DFlashDrafter, prompt: np.ndarray, n: int
                   ) -> tuple[list[int], list[int], bool]:
    """tileinfer's dflash_greedy (numpy) for n tokens after prompt, then this script's evaluation
    (`anchored_acceptance`, `round_lengths`) over the continuation it produced: (its round lengths, ours,
    whether they agree). dflash_greedy drafts fewer than B-1 tokens (a shorter block) once fewer are
    wanted, so only its rounds anchored where a whole block and the token after it fit in n are compared."""
    from tileinfer.model.dflash_reference import dflash_greedy

    b = drafter.config.block_size
    continuation, numpy_lengths = dflash_greedy(reference_target, reference, prompt, n)
    sequence = torch.from_numpy(np.concatenate([prompt, continuation]).astype(np.int64))[None]
    features, _ = target_pass(target, sequence, drafter.config.target_layer_ids, autocast=False)
    held = HeldOut(len(prompt), sequence, features)
    embed = target.model.embed_tokens.weight
    torch_lengths = round_lengths(anchored_acceptance(drafter, embed, held, autocast=False)[0].numpy())
    anchors = len(prompt) + np.concatenate([[0], np.cumsum(numpy_lengths)[:-1]])
    whole = [length for length, a in zip(numpy_lengths, anchors) if a <= len(prompt) + n - 1 - b]
    return numpy_lengths, torch_lengths, torch_lengths[:len(whole)] == whole


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tileinfer/demo/target", help="the target's directory (train_demo's)")
    parser.add_argument("--data", default="build/demo-data", help="scripts/prepare_demo_data.py's output")
    parser.add_argument("--out", default=None, help="build/demo-dflash (build/demo-dflash-smoke with --smoke)")
    parser.add_argument("--minutes", type=float, default=4.0, help="time budget, the last evaluation and writing "
                                                                   "included; cuts the schedule if reached")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"the schedule's length ({DEMO[1].steps}; {SMOKE[1].steps} with --smoke)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a 1-layer drafter, a few dozen steps (CPU-sized)")
    parser.add_argument("--check", action="store_true", help="compare the written drafter with tileinfer's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    start = time.time()
    deadline = start + args.minutes * 60 - (WRITE_MARGIN_S if not args.smoke else 5)
    target_dir, data = Path(args.target), Path(args.data)
    out = Path(args.out or ("build/demo-dflash-smoke" if args.smoke else "build/demo-dflash"))
    if not (data / "tokens.npz").is_file():
        parser.error(f"{data}/tokens.npz not found: run scripts/prepare_demo_data.py first")
    shape, t = SMOKE if args.smoke else DEMO
    if args.steps is not None:
        t = dataclasses.replace(t, steps=args.steps)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train-log.jsonl", "w")

    def log(**fields) -> None:
        print(f"[{time.time() - start:6.0f}s] " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
        log_file.write(json.dumps({"time_s": round(time.time() - start, 1), **fields}) + "\n")
        log_file.flush()

    torch.backends.cuda.matmul.allow_tf32 = True
    if args.device == "cpu":
        torch.set_num_threads(1)    # CPU runs are smoke tests; intra-op threads crawl on a shared machine
    torch.manual_seed(args.seed)
    config = drafter_config(read_config(target_dir), shape, mask_token_id(target_dir))
    tokens = train_demo.Tokens(data, args.device)
    if any(bool((s == config.mask_token_id).any()) for s in [tokens.train, *tokens.held_out.values()]):
        raise SystemExit(f"the mask token {MASK_TOKEN} ({config.mask_token_id}) occurs in the data")
    target = load_target(target_dir, args.device)
    drafter = DFlashDrafter(config).to(args.device)
    params = num_parameters(config)
    log(params=params, bf16_mb=round(2 * params / 1e6, 2), device=args.device, train_tokens=len(tokens.train),
        mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids),
        shape=dataclasses.asdict(shape), train=dataclasses.asdict(t))
    best_state, best_step, best = train(drafter, target, tokens, t, args, deadline, log)
    nbytes = write_drafter(best_state, config, out, notice((data / "NOTICE").read_text(), config.mask_token_id))
    log(wrote=str(out), weight_bytes=nbytes, best_step=best_step, best_held_out_acceptance=round(best["mean"], 3))
    log_file.close()
    if args.check:
        check(out, target_dir, {k: v.cpu() for k, v in tokens.held_out.items()}, t, args.seed)
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
