"""Launchers for cuda_src/sampling.cu: greedy argmax and seeded temperature/top-k/top-p sampling."""
from ..cuda import I32, DeviceArray, kernel
from ._check import FLOAT32, INT32, UINT64, expect


def argmax(logits: DeviceArray, out: DeviceArray, stream) -> None:
    """out[r] = argmax(logits[r]) (lowest index on ties)."""
    rows, vocab = logits.shape
    expect("logits", logits, (rows, vocab), FLOAT32)
    expect("out", out, (rows,), INT32)
    kernel("sampling.cu", "argmax_rows").launch((rows,), (1024,), [logits, I32(vocab), out], stream)


def sample(logits: DeviceArray, temperature: DeviceArray, top_k: DeviceArray, top_p: DeviceArray,
           seeds: DeviceArray, counters: DeviceArray, out: DeviceArray, stream) -> None:
    """Per row r: greedy if temperature[r] <= 0, else a Gumbel-max sample from the top-k/top-p
    filtered softmax(logits[r] / temperature[r]), seeded by (seeds[r], counters[r])."""
    rows, vocab = logits.shape
    expect("logits", logits, (rows, vocab), FLOAT32)
    for name, arr, dtype in (("temperature", temperature, FLOAT32), ("top_k", top_k, INT32),
                             ("top_p", top_p, FLOAT32), ("seeds", seeds, UINT64),
                             ("counters", counters, INT32), ("out", out, INT32)):
        expect(name, arr, (rows,), dtype)
    kernel("sampling.cu", "sample_rows").launch(
        (rows,), (1024,), [logits, I32(vocab), temperature, top_k, top_p, seeds, counters, out], stream)
