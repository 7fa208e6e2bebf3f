"""A float32 numpy DFlash drafter (z-lab's DFlashDraftModel): the oracle of its runners and of the engine's rounds.

One draft forward, for a request whose committed tokens end at position `start` (the last of them not yet
through the target):
  context  c = hidden_norm(fc(f)) for the positions the target computed since the previous draft, f being
           their hidden states after target_layer_ids side by side [m, hidden]; one c serves every layer
  block    the last committed token and k mask tokens at positions start..start+k, embedded by the
           target's embedding (unscaled) [k + 1, hidden]
  per layer, pre-norm, x = input_layernorm(h):
           q = rope(q_norm(q_proj(x)))                               at the block's positions
           k = rope(k_norm(k_proj([c; x]))), v = v_proj([c; x])      at the context's, then the block's positions
           (the context's rows and the block's go through k_proj/v_proj apart: `write_context`, then the
           block); the new keys and values join the drafter's cache; every query of the block reads every entry
           (earlier context, new context, the whole block): no causal mask
           h += o_proj(attention); h += mlp(post_attention_layernorm(h))     (Qwen3's gated SiLU MLP)
  drafts   argmax over the target's LM head of norm(h) at block rows 1..k: row j is the token AT position
           start + j, not the one after it.
After a forward the cache is cut back to the context (z-lab's `crop`): the block's keys and values are
dropped, so between rounds a drafter's cache holds context only.

`dflash_greedy` plays z-lab's `dflash_generate` (greedy) with this drafter beside a ReferenceModel target.
"""
from __future__ import annotations

import numpy as np

from tileinfer.model.checkpoint import dflash_tensors
from tileinfer.model.dflash_config import DFlashConfig
from tileinfer.model.reference import (ReferenceCache, ReferenceModel, apply_rope, as_float32, block_attention,
                                       decoder_layer, rms_norm, rope_table)


class DFlashReference:
    """The drafter's own weights in float32; the embedding and LM head are its target's (`bind_target`)."""

    def __init__(self, config: DFlashConfig, weights: dict[str, np.ndarray]):
        shapes = dflash_tensors(config)
        missing = [name for name in shapes if name not in weights]
        if missing:
            raise ValueError(f"weights lack {', '.join(map(repr, missing[:3]))}"
                             f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}; is this a DFlash "
                             f"drafter of {config.num_hidden_layers} layers?")
        w = {name: as_float32(name, weights[name], shape) for name, shape in shapes.items()}
        self.config = config
        self.fc = w["fc.weight"]                   # [hidden, feature_size]
        self.hidden_norm = w["hidden_norm.weight"]  # [hidden]
        self.layers = [decoder_layer(config.decoder, w, f"layers.{i}.") for i in range(config.num_hidden_layers)]
        self.norm = w["norm.weight"]               # [hidden]
        self.inv_freq = rope_table(config.decoder)
        self.embed: np.ndarray | None = None       # [vocab, hidden], the target's
        self.lm_head: np.ndarray | None = None     # [vocab, hidden], the target's

    @classmethod
    def from_checkpoint(cls, ckpt) -> "DFlashReference":
        """From any object with `.config` (a DFlashConfig) and `.read(name)` (Checkpoint.open_draft's)."""
        shapes = dflash_tensors(ckpt.config)
        return cls(ckpt.config, {name: as_float32(name, ckpt.read(name), shape) for name, shape in shapes.items()})

    def bind_target(self, target: ReferenceModel) -> None:
        """Draft for `target` (checked to fit): its embedding and LM head."""
        self.config.check_target(target.config)
        self.embed, self.lm_head = target.embed, target.lm_head

    def new_cache(self) -> ReferenceCache:
        c = self.config
        return ReferenceCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)

    def block(self, last_token: int, k: int) -> list[int]:
        """A draft forward's tokens: the last committed one and k masks."""
        return [int(last_token)] + [self.config.mask_token_id] * k

    # ------------------------------------------------------------------ forward
    def context(self, features: np.ndarray) -> np.ndarray:
        """hidden_norm(fc(features)): [m, feature_size] target states -> [m, hidden]."""
        features = np.asarray(features, np.float32).reshape(-1, self.config.feature_size)
        return rms_norm(features @ self.fc.T, self.hidden_norm, self.config.decoder.rms_norm_eps)

    def write_context(self, features: np.ndarray, positions, cache, entry: int) -> None:
        """The context entries of `features` [m, feature_size] at target `positions` [m]: every layer's keys
        and values of c = hidden_norm(fc(features)), written at entries entry..entry+m-1 of `cache` (the caller
        has made room). A draft forward writes its new context this way before its block; the engine writes
        each context as it arrives (engine/dflash.py)."""
        positions = np.asarray(positions, np.int64)
        c = self.context(features)
        if len(c) != len(positions):
            raise ValueError(f"{len(c)} context features for {len(positions)} context positions")
        if not len(c):
            return
        for index, layer in enumerate(self.layers):
            cache.write(index, entry, *self._keys_values(layer, c, positions))

    def forward(self, features: np.ndarray, context_positions, block_ids, start: int, cache, entry: int = 0
                ) -> np.ndarray:
        """The logits of block rows 1..k [k, vocab] (row j predicts the token at position start + j).

        features [m, feature_size] at context_positions [m] (m may be 0: the context is in the cache already);
        block_ids [k + 1] at positions start..start+k. `cache` has `write(layer, entry, k, v)` and
        `read(layer) -> (keys, values, positions)` (a ReferenceCache, or the CPU runner's view of a paged cache);
        the caller has made room for the m context entries and then the k + 1 block entries at `entry`, and
        cuts the block's off afterwards."""
        if self.embed is None:
            raise RuntimeError("bind_target() first: a DFlash drafter embeds and decodes with its target's weights")
        ids = np.asarray(block_ids, np.int64)
        if ids.ndim != 1 or len(ids) < 2:
            raise ValueError(f"a block is the last committed token and at least one mask, got {len(ids)} token(s)")
        m = len(context_positions)
        self.write_context(features, context_positions, cache, entry)
        block_positions = start + np.arange(len(ids))
        eps = self.config.decoder.rms_norm_eps
        h = self.embed[ids]  # [k + 1, hidden]
        for index, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps)
            h = h + self._attention(layer, index, x, block_positions, cache, entry + m)
            h = h + layer.mlp(rms_norm(h, layer.post_norm, eps), lambda t: t)
        return rms_norm(h[1:], self.norm, eps) @ self.lm_head.T

    def _keys_values(self, layer, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A layer's keys (k_norm, then RoPE at `positions`) and values of rows x [n, hidden]."""
        d = self.config.decoder
        k = (x @ layer.k_proj.T).reshape(len(x), d.num_key_value_heads, d.head_dim)
        v = (x @ layer.v_proj.T).reshape(len(x), d.num_key_value_heads, d.head_dim)
        return apply_rope(rms_norm(k, layer.k_norm, d.rms_norm_eps), positions, self.inv_freq), v

    def _attention(self, layer, index: int, x: np.ndarray, block_positions: np.ndarray, cache, entry: int
                   ) -> np.ndarray:
        """The block's attention: its keys and values join the cache at `entry` (after the context's), and
        every query reads every entry (no mask)."""
        d = self.config.decoder
        n = len(x)
        q = (x @ layer.q_proj.T).reshape(n, d.num_attention_heads, d.head_dim)
        q = apply_rope(rms_norm(q, layer.q_norm, d.rms_norm_eps), block_positions, self.inv_freq)
        cache.write(index, entry, *self._keys_values(layer, x, block_positions))
        keys, values, _ = cache.read(index)
        return block_attention(q, keys, values).reshape(n, d.q_size) @ layer.o_proj.T

    def draft(self, features: np.ndarray, context_positions, last_token: int, k: int, start: int,
              cache: ReferenceCache) -> list[int]:
        """k drafts for the positions after `start` over a ReferenceCache holding the earlier context: the
        new context is appended to it for good, the block only for this forward."""
        context_positions = np.asarray(context_positions, np.int64)
        entry = cache.append_positions(np.concatenate([context_positions, start + np.arange(k + 1)]))
        try:
            logits = self.forward(features, context_positions, self.block(last_token, k), start, cache, entry)
        except BaseException:
            cache.truncate(entry)
            raise
        cache.truncate(entry + len(context_positions))
        return [int(t) for t in logits.argmax(axis=1)]


def dflash_greedy(target: ReferenceModel, drafter: DFlashReference, prompt, n: int,
                  max_draft_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """n greedy tokens by DFlash rounds, as z-lab's dflash_generate plays them: (the tokens, each round's
    acceptance length = accepted drafts + 1). A round drafts min(max_draft_tokens, tokens still wanted - 1)
    tokens (block_size - 1 at most), the target verifies them and the last committed token in one forward,
    and the target's hidden states at the positions it kept become the drafter's next context."""
    k_max = drafter.config.max_draft_tokens if max_draft_tokens is None else max_draft_tokens
    layer_ids = drafter.config.target_layer_ids
    target_cache, draft_cache = target.new_cache(), drafter.new_cache()
    logits, features = target.forward_features(prompt, layer_ids, target_cache)
    positions = np.arange(len(prompt))   # of the context not yet in the drafter's cache
    out, lengths = [int(np.argmax(logits[-1]))], []
    while len(out) < n:
        start = len(prompt) + len(out) - 1  # the last committed token's position
        k = min(k_max, n - len(out) - 1)
        drafts = []
        if k > 0:
            drafts = drafter.draft(features, positions, out[-1], k, start, draft_cache)
            features, positions = features[:0], positions[:0]
        logits, verified = target.forward_features([out[-1]] + drafts, layer_ids, target_cache)
        best = logits.argmax(axis=1)
        accepted = next((i for i, (x, y) in enumerate(zip(drafts, best)) if x != y), len(drafts))
        target_cache.truncate(start + 1 + accepted)
        features = np.concatenate([features, verified[:accepted + 1]])
        positions = np.concatenate([positions, start + np.arange(accepted + 1)])
        out += drafts[:accepted] + [int(best[accepted])]
        lengths.append(accepted + 1)
    return out[:n], lengths
