"""Launchers for cuda_src/sampling.cu: greedy argmax, seeded temperature/min-p/top-k/top-p sampling
after a request's logit bias and vLLM's repetition/presence/frequency penalties."""
from ..cuda import I32, DeviceArray, kernel
from ._check import FLOAT32, INT32, UINT64, expect


def argmax(logits: DeviceArray, out: DeviceArray, stream) -> None:
    """out[r] = argmax(logits[r]) (lowest index on ties)."""
    rows, vocab = logits.shape
    expect("logits", logits, (rows, vocab), FLOAT32)
    expect("out", out, (rows,), INT32)
    kernel("sampling.cu", "argmax_rows").launch((rows,), (1024,), [logits, I32(vocab), out], stream)


def sample(logits: DeviceArray, temperature: DeviceArray, top_k: DeviceArray, top_p: DeviceArray,
           min_p: DeviceArray, seeds: DeviceArray, counters: DeviceArray, out: DeviceArray, stream, *,
           penalties: tuple[DeviceArray, ...] | None = None, masks: tuple[DeviceArray, DeviceArray] | None = None,
           head_keys: DeviceArray | None = None,
           host_out: DeviceArray | None = None, host_slot: DeviceArray | None = None) -> None:
    """Per row r: greedy if temperature[r] <= 0, else a Gumbel-max sample from the min-p, then top-k,
    then top-p filtered softmax(logits[r] / temperature[r]), seeded by (seeds[r], counters[r]).
    min_p[r] <= 0 disables min-p (it keeps probabilities >= min_p[r] * the largest).

    penalties: (offsets, tokens, counts, biases, repetition, presence, frequency), the logit bias and vLLM's
    penalties applied in place to the logits first, in the same launch. Row r's entries e in [offsets[r],
    offsets[r + 1]) name distinct token ids tokens[e]: logits[r, t] gets biases[e] added (0: none); then if
    counts[e] >= 0 (t is a prompt or output token, counts[e] its occurrences in the output) it is divided by
    repetition[r] when positive (else multiplied; 1 = off) and reduced by frequency[r] * counts[e] +
    (presence[r] if counts[e] > 0); counts[e] == -1 bans t (-inf); -2: t is only biased. Rows without entries
    are left alone; ids outside the vocabulary are skipped. Rounded as runner/sampler.apply_penalties rounds.

    masks: (mask_rows, bitmasks): row r's allowed tokens are bitmask mask_rows[r] (int32 words, bit t % 32 of
    word t // 32 for token t; mask_rows[r] < 0: no mask); every other logit becomes -inf after the penalties
    (structured output; runner/sampler.apply_mask).

    head_keys: the per-block keys the batch-1 LM head wrote with the logits (linear(head_keys=)), for
    one row only; row 0's largest logit is then read from them (a few KB instead of the vocabulary)
    unless row 0 has penalty entries.

    host_out: mapped page-locked memory [slots, stride] (PinnedBuffer(mapped=True).device_array) that
    also receives the tokens, in row host_slot[0] (an int32 on the device): read by the host after the
    step's event, with no copy enqueued."""
    rows, vocab = logits.shape
    expect("logits", logits, (rows, vocab), FLOAT32)
    for name, arr, dtype in (("temperature", temperature, FLOAT32), ("top_k", top_k, INT32),
                             ("top_p", top_p, FLOAT32), ("min_p", min_p, FLOAT32), ("seeds", seeds, UINT64),
                             ("counters", counters, INT32), ("out", out, INT32)):
        expect(name, arr, (rows,), dtype)
    pen_args = [None] * 7
    if penalties is not None:
        if len(penalties) != 7:
            raise ValueError(f"sample: penalties are (offsets, tokens, counts, biases, repetition, presence, "
                             f"frequency), got {len(penalties)} arrays")
        offsets, tokens, counts, biases, repetition, presence, frequency = penalties
        expect("penalty offsets", offsets, (rows + 1,), INT32)
        expect("penalty tokens", tokens, (None,), INT32)
        expect("penalty counts", counts, tokens.shape, INT32)
        expect("penalty biases", biases, tokens.shape, FLOAT32)
        for name, arr in (("repetition", repetition), ("presence", presence), ("frequency", frequency)):
            expect(name, arr, (rows,), FLOAT32)
        pen_args = list(penalties)
    mask_args = [None, None, I32(0)]
    if masks is not None:
        mask_rows, bitmasks = masks
        expect("mask_rows", mask_rows, (rows,), INT32)
        expect("bitmasks", bitmasks, (None, None), INT32)
        if bitmasks.shape[1] * 32 < vocab:
            raise ValueError(f"sample: bitmasks of {bitmasks.shape[1]} words cover {bitmasks.shape[1] * 32} tokens, "
                             f"the vocabulary has {vocab}")
        mask_args = [mask_rows, bitmasks, I32(bitmasks.shape[1])]
    num_keys = 0
    if head_keys is not None:
        if rows != 1:
            raise ValueError(f"sample: head_keys serve one row of logits, got {rows}")
        expect("head_keys", head_keys, (None,), UINT64)
        num_keys = head_keys.shape[0]
    stride = 0
    if host_out is not None:
        expect("host_out", host_out, (None, None), INT32)
        expect("host_slot", host_slot, (1,), INT32)
        stride = host_out.shape[1]
        if stride < rows:
            raise ValueError(f"sample: host_out rows hold {stride} tokens, the step samples {rows}")
    kernel("sampling.cu", "sample_rows").launch(
        (rows,), (1024,), [logits, I32(vocab), temperature, top_k, top_p, min_p, seeds, counters, out, head_keys,
                           I32(num_keys), *pen_args, *mask_args, host_out, host_slot, I32(stride)], stream,
        smem=bitmasks.shape[1] * 4 if masks is not None else 0)  # a row's bitmask, in shared memory

