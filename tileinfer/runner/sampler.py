"""The sampling rule of cuda_src/sampling.cu, in numpy: the specification and the tests' oracle.

Greedy (temperature <= 0) is the argmax, lowest index on ties. Otherwise z = logits / T;
min-p keeps the tokens with z >= max z + log(min_p) (probability >= min_p * the largest);
top-k then keeps, of those, the tokens with z >= the k-th largest z; top-p then keeps the
smallest top set (by threshold) whose softmax mass within the min-p and top-k set reaches p.
The sample is argmax over kept i of z_i + g_i, g_i = -log(-log(u_i)),
u_i = uniform01(seed, counter, i): the Gumbel-max trick, which draws exactly from softmax
over the kept set.

A request's logit bias and vLLM's penalties, applied to the logits before all of that, are `apply_penalties`.
"""
from __future__ import annotations

import numpy as np


MAX_BANNED_TOKENS = 64  # tokens one request may ban (min_tokens: its EOS and stop ids); the sampler keeps room
MAX_LOGIT_BIAS = 512    # tokens one request may bias (logit_bias); the sampler keeps room for them too

def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def uniform01(seed: int, counter: int, index: np.ndarray) -> np.ndarray:
    """Uniform floats in (0, 1), bit-identical to the kernel's uniform01. # [len(index)] float32"""
    key = (np.uint64(counter & 0xFFFFFFFF) << np.uint64(32)) | index.astype(np.uint64)
    h = _splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _splitmix64(key))
    return ((h >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)


def scaled(logits: np.ndarray, temperature: float) -> np.ndarray:
    """z = logits * (1 / T) in float32, rounded as the kernel rounds it."""
    return logits.astype(np.float32) * (np.float32(1.0) / np.float32(temperature))


def min_p_cut(zmax: np.float32, min_p: float) -> np.float32:
    """min-p's threshold on z: zmax + log(min(min_p, 1)), the log rounded from float64 to float32
    and the add rounded in float32 (exactly the kernel's arithmetic). -inf when min_p <= 0 (off)."""
    min_p = float(np.float32(min_p))  # as the kernel reads it
    if not min_p > 0:
        return np.float32(-np.inf)
    return np.float32(zmax) + np.float32(np.log(min(min_p, 1.0)))


def kept_mask(logits: np.ndarray, temperature: float, top_k: int, top_p: float, *,
              min_p: float = 0.0) -> np.ndarray:
    """Which tokens survive min-p, then top-k, then top-p. # [vocab] bool"""
    z = scaled(logits, temperature)
    keep = z >= min_p_cut(z.max(), min_p)
    if 0 < top_k < int(keep.sum()):
        keep &= z >= np.sort(z[keep])[::-1][top_k - 1]
    if top_p < 1.0:  # (top_p <= 0, which the API rejects, keeps the largest z only, as the kernel does)
        candidates = z[keep]
        order = np.argsort(-candidates, kind="stable")
        sorted_z = candidates[order]
        cum = np.cumsum(np.exp((sorted_z - sorted_z[0]).astype(np.float64)))
        idx = int(np.searchsorted(cum, top_p * cum[-1]))  # first prefix whose mass reaches p
        keep &= z >= sorted_z[min(idx, sorted_z.size - 1)]
    return keep


def gumbel_choice(z: np.ndarray, keep: np.ndarray, seed: int, counter: int) -> int:
    """argmax over kept i of z_i + g_i (float32, lowest index on ties): the kernel's draw."""
    idx = np.nonzero(keep)[0]
    u = uniform01(seed, counter, idx.astype(np.uint64))
    g = -np.log(-np.log(u))
    return int(idx[np.argmax(z[idx] + g)])


def sample(logits: np.ndarray, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           seed: int = 0, counter: int = 0) -> int:
    """The token the kernel picks for one row of logits."""
    if not temperature > 0:
        return int(np.argmax(logits))
    keep = kept_mask(logits, temperature, top_k, top_p, min_p=min_p)
    return gumbel_choice(scaled(logits, temperature), keep, seed, counter)


def apply_penalties(logits_row: np.ndarray, tokens, counts, repetition: float, presence: float,
                    frequency: float, biases=None) -> np.ndarray:
    """A request's logit bias and vLLM's penalties on one row, as the kernel applies them; returns a new float32
    row.

    tokens: distinct ids; biases (default none): each one's bias, added first where it is not 0; counts: for a
    token of the row's prompt or output, its occurrences in the output (0: prompt only), then l = logits[t]; if
    repetition != 1, l = l / repetition when l > 0, else l * repetition; then l -= frequency * count + (presence
    if count > 0) (output tokens only); -1 bans the token (-inf); -2: the token is only biased. Every operation
    rounds in float32; ids outside [0, vocab) are skipped.
    """
    row = np.array(logits_row, np.float32)  # a copy
    tokens, counts = np.asarray(tokens, np.int64), np.asarray(counts, np.int32)
    biases = np.zeros(tokens.shape, np.float32) if biases is None else np.asarray(biases, np.float32)
    if tokens.shape != counts.shape or tokens.shape != biases.shape or tokens.ndim != 1:
        raise ValueError(f"apply_penalties: tokens {tokens.shape}, counts {counts.shape} and biases {biases.shape} "
                         f"must be equal-length 1-D")
    if np.unique(tokens).size != tokens.size:
        raise ValueError("apply_penalties: a row's token ids must be distinct")
    valid = (tokens >= 0) & (tokens < row.size)
    tokens, counts, biases = tokens[valid], counts[valid], biases[valid]
    rep, pres, freq = np.float32(repetition), np.float32(presence), np.float32(frequency)
    l = row[tokens]
    l = np.where(biases != 0, l + biases, l)  # (not 0: -0 + 0 would turn a -0 logit into +0)
    seen = counts >= 0
    if rep != np.float32(1):
        l = np.where(seen, np.where(l > 0, l / rep, l * rep), l)
    penalty = freq * counts.astype(np.float32) + np.where(counts > 0, pres, np.float32(0))
    row[tokens] = np.where(counts == -1, np.float32(-np.inf), np.where(seen, l - penalty, l))
    return row


def apply_mask(logits_row: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A new row with every token the bitmask does not allow at -inf, as the sampling kernel applies it:
    mask is int32 words, bit t % 32 of word t // 32 set when token t is allowed."""
    bits = np.unpackbits(np.asarray(mask, np.int32).view(np.uint8), bitorder="little").astype(bool)
    row = np.array(logits_row, np.float32)
    allowed = np.zeros(row.size, bool)
    allowed[:min(bits.size, row.size)] = bits[:row.size]
    row[~allowed] = -np.inf
    return row
