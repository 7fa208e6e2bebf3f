"""The wgmma prefill attention (cuda_src/attention_wg.cu) as tileinfer.kernels.attention routes it on Hopper:
against the numpy reference and against attention_prefill.cu's rows mode (attention(..., wg=False)) at awkward sizes (lengths
around its 128-row blocks and 128-key tiles, pages partly filled and across key tiles, GQA groups 1, 2 and 4,
chunked prefill over cached pages, several sequences a launch), the routing of the other shapes, and the whole
model's logits with and without it. Skipped on other GPUs (the kernel needs sm_90a).

    python3 -m pytest -q tests/gpu/test_attention_wg.py

`-k smoke` runs two small launches (a deadlock in the kernel's producer/consumer pipeline shows there as a hang).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import pytest

import tileinfer
from tileinfer.cuda.module import Kernel
from tileinfer.kernels import attention
from tileinfer.model import reference

from gpu_helpers import seed_of, to_f32
from test_kernels import BF16, HD, PagedBatch, assert_close, check_attention

pytestmark = pytest.mark.gpu

REF_ROWS = 1 << 21  # above this many (query, key) pairs a sequence, the reference covers a sample of its queries


@pytest.fixture(autouse=True)
def hopper(device):
    if device.info.arch != "sm_90":
        pytest.skip(f"attention_wg.cu needs a Hopper GPU (sm_90a); this one is {device.info.arch}")


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def kernels_launched():
    """Yields the list of the entry points launched in the block, by name, in order."""
    names: list[str] = []
    launch = Kernel.launch

    def recording_launch(self, *args, **kwargs):
        names.append(self.name)
        return launch(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Kernel, "launch", recording_launch)
        yield names


def device_inputs(batch: PagedBatch, buf):
    if batch._device is None:
        arrays = (batch.q, batch.k_pool, batch.v_pool, batch.cu_q, batch.kv_lens, batch.block_tables)
        batch._device = [buf.upload(a) for a in arrays]
    return batch._device[:6]


def run_rows(batch: PagedBatch, buf, stream, wg: bool) -> np.ndarray:
    """attention() in its rows (prefill) shape, whatever the row count (decode_shape=False, as in batch-invariant
    mode): attention_wg.cu with wg, attention_prefill.cu's `attention` without. # [T, H, HD] bf16"""
    q, k_pool, v_pool, cu_q, kv_lens, tables = device_inputs(batch, buf)
    out = buf.poisoned((batch.T, batch.H, HD), BF16)
    with kernels_launched() as names:
        attention(q, k_pool, v_pool, out, cu_q, kv_lens, tables, max_q_len=batch.max_q_len, decode_shape=False,
                  wg=wg, stream=stream)
    assert names == ["attention_wg" if wg else "attention"], names
    return out.to_host(stream)


def reference_rows(batch: PagedBatch, rng) -> tuple[np.ndarray, np.ndarray]:
    """(token indices, reference [len, H, HD]): every token of small batches; for long sequences the first 8,
    the last 24 and 32 drawn in between (the reference over 4,096 x 4,096 positions costs too much CPU)."""
    idx, ref = [], []
    for b, (q_len, kv_len) in enumerate(batch.spec):
        if q_len == 0:
            continue
        c0 = int(batch.cu_q[b])
        if q_len * kv_len <= REF_ROWS:
            sub = np.arange(q_len)
        else:
            middle = rng.choice(np.arange(8, q_len - 24), size=min(32, q_len - 32), replace=False)
            sub = np.unique(np.concatenate([np.arange(8), middle, np.arange(q_len - 24, q_len)]))
        q_pos, k_pos = kv_len - q_len + sub, np.arange(kv_len)
        ref.append(reference.attention(to_f32(batch.q[c0 + sub]), to_f32(batch.keys[b]), to_f32(batch.values[b]),
                                       q_pos, k_pos))
        idx.append(c0 + sub)
    return np.concatenate(idx), np.concatenate(ref)


def check_batch(batch: PagedBatch, buf, stream, seed) -> None:
    """Both kernels against the reference (attention_prefill.cu's result checks the harness itself), and each other:
    both bf16 outputs within ~2^-8 of the exact result (different summation orders and tile sizes), so
    elementwise rtol 1e-2 + atol 1e-2 max|v|, and ||diff|| / ||attention_prefill.cu|| < 1e-2 (expected ~3e-3)."""
    idx, ref = reference_rows(batch, np.random.default_rng(seed))
    old = run_rows(batch, buf, stream, wg=False)
    check_attention(old[idx], ref, batch.vmax, batch.label(1) + " attention_prefill.cu rows mode")
    got = run_rows(batch, buf, stream, wg=True)
    label = batch.label(1) + " attention_wg"
    assert np.isfinite(to_f32(got)).all(), f"{label}: rows left unwritten (poison) or non-finite"
    check_attention(got[idx], ref, batch.vmax, label)
    assert_close(got, old, atol=1e-2 * batch.vmax, rtol=1e-2, rel_norm=1e-2, label=label + " vs attention_prefill.cu")


# ----------------------------------------------------------------------------- smoke
@pytest.mark.parametrize("spec, H", [([(65, 65)], 32), ([(17, 17), (0, 0), (37, 137)], 16)], ids=["one", "three"])
def test_attention_wg_smoke(spec, H, buf, stream):
    batch = PagedBatch(np.random.default_rng(seed_of("wg-smoke", spec, H)), spec, H, 8, 64)
    check_batch(batch, buf, stream, seed_of("wg-smoke-ref", spec))


# ----------------------------------------------------------------------------- single sequences
# A fresh prefill of n tokens (q_len == kv_len): lengths around the 64/128-key tiles and 128-row blocks.
LENGTHS = [1, 17, 63, 64, 65, 127, 129, 1000, 4096]
PREFILL = ([pytest.param(n, 32, 64, id=f"n{n}-G4-page64") for n in LENGTHS]
           + [pytest.param(n, 16, 16, id=f"n{n}-G2-page16") for n in (1, 65, 129, 1000, 4096)]
           + [pytest.param(n, 32, 24, id=f"n{n}-G4-page24") for n in (200, 1000)]    # pages across key tiles
           + [pytest.param(300, 8, 1, id="n300-G1-page1")])


@pytest.mark.parametrize("n, H, page_size", PREFILL)
def test_attention_wg_prefill(n, H, page_size, buf, stream):
    batch = PagedBatch(np.random.default_rng(seed_of("wg-prefill", n, H, page_size)), [(n, n)], H, 8, page_size)
    check_batch(batch, buf, stream, seed_of("wg-prefill-ref", n, H, page_size))


# ----------------------------------------------------------------------------- batches, chunked prefill
BATCHES = [
    # several sequences of different lengths in one launch (a padding sequence (0, 0) among them)
    pytest.param([(1000, 1000), (17, 17), (1, 1), (0, 0), (129, 129)], 32, 64, id="mixed-G4-page64"),
    pytest.param([(63, 63), (64, 64), (65, 65), (127, 127)], 16, 16, id="mixed-G2-page16"),
    # chunked prefill: queries start mid-sequence (kv_len > q_len), the cached part across pages
    pytest.param([(37, 137)], 32, 64, id="chunk37-after100-G4"),
    pytest.param([(300, 1000)], 16, 24, id="chunk300-after700-G2-page24"),
    pytest.param([(64, 4160)], 32, 64, id="chunk64-after4096-G4"),
    pytest.param([(128, 1153), (1, 4096), (200, 200), (33, 97)], 32, 16, id="chunks-and-prefill-G4-page16"),
    pytest.param([(37, 137), (1000, 1000), (5, 5)], 16, 24, id="mixed-G2-page24"),
    pytest.param([(700, 2000)], 32, 16, id="chunk700-after1300-G4-page16"),
    pytest.param([(1000, 3000), (4096, 4096)], 32, 64, id="long-chunk-and-4096-G4"),
]


@pytest.mark.parametrize("spec, H, page_size", BATCHES)
def test_attention_wg_batch(spec, H, page_size, buf, stream):
    batch = PagedBatch(np.random.default_rng(seed_of("wg-batch", spec, H, page_size)), spec, H, 8, page_size)
    check_batch(batch, buf, stream, seed_of("wg-batch-ref", spec, H, page_size))


@pytest.mark.parametrize("spec", [[(1000, 1000)], [(300, 2300), (129, 129)]], ids=["prefill", "chunk-and-prefill"])
def test_attention_wg_rising_scores(spec, buf, stream):
    # Keys growing 8-fold along the sequence: a query's scores (std ~2 at the start, ~16 at the end, in natural
    # units) keep passing the reference max the kernel rescales against, so O and l are rescaled late in the
    # sequence as well as at its first key tile.
    batch = PagedBatch(np.random.default_rng(seed_of("wg-rising", spec)), spec, 32, 8, 64, k_growth=7.0)
    check_batch(batch, buf, stream, seed_of("wg-rising-ref", spec))


@pytest.mark.parametrize("jump", [4.0, 40.0])
def test_attention_wg_jumping_scores(jump, buf, stream):
    # Keys 4 or 40 times larger from the middle of the sequence on: there a query's scores leap past the reference
    # max by far more than 2^8 (at 40x, 2^(score - old max) would overflow float32), so O and l are rescaled at
    # that key tile by factors that underflow to 0 at 40x, and the rows' outputs come from the late keys.
    batch = PagedBatch(np.random.default_rng(seed_of("wg-jump", jump)), [(1000, 1000), (300, 2300)], 32, 8, 64,
                       k_jump=jump)
    check_batch(batch, buf, stream, seed_of("wg-jump-ref", jump))


def test_attention_wg_repeatable(buf, stream):
    # The same launch twice gives the same bits (no race between the producer and the consumers).
    batch = PagedBatch(np.random.default_rng(seed_of("wg-repeat")), [(1000, 1000), (300, 2300)], 32, 8, 64)
    first = run_rows(batch, buf, stream, wg=True)
    for _ in range(3):
        again = run_rows(batch, buf, stream, wg=True)
        assert np.array_equal(first.view(np.uint16), again.view(np.uint16)), "two identical launches differ"


def test_attention_wg_query_is_summed_alike_wherever_it_sits(buf, stream):
    # Batch-invariant mode (runner/gpu.py) runs every BF16 attention launch in the rows shape, so on Hopper
    # on attention_wg: a query must give the same bits as a decode step (one query over its cached prefix) as
    # in a prefill chunk (another row of another block, whose key range runs further), alone or beside others.
    batch = PagedBatch(np.random.default_rng(seed_of("wg-invariant")), [(300, 300)], 32, 8, 16)
    prefill = run_rows(batch, buf, stream, wg=True)
    _, k_pool, v_pool, _, _, _ = device_inputs(batch, buf)
    for t in (0, 127, 128, 200, 299):
        # Sequences over the same pages, (first token, count): queries first .. first + count - 1 at their
        # positions (kv_len = first + count). Token t alone, then after a chunk of 10 at positions 40 .. 49.
        for seqs in ([(t, 1)], [(40, 10), (t, 1)]):
            q = np.concatenate([batch.q[first:first + count] for first, count in seqs])
            cu_q = np.cumsum([0] + [count for _, count in seqs]).astype(np.int32)
            kv_lens = np.array([first + count for first, count in seqs], np.int32)
            tables = np.repeat(batch.block_tables[:1], len(seqs), axis=0)
            out = buf.poisoned((len(q), batch.H, HD), BF16)
            with kernels_launched() as names:
                attention(buf.upload(q), k_pool, v_pool, out, buf.upload(cu_q), buf.upload(kv_lens),
                          buf.upload(tables), max_q_len=max(count for _, count in seqs), decode_shape=False,
                          stream=stream)
            assert names == ["attention_wg"], names
            got = out.to_host(stream)[-1]
            assert np.array_equal(got.view(np.uint16), prefill[t].view(np.uint16)), \
                f"token {t} as the last of {seqs}: not bitwise its row of the prefill"


# ----------------------------------------------------------------------------- routing
def test_attention_routes_only_the_unsplit_bf16_prefill_shape(buf, stream):
    # A prefill-shaped BF16 launch runs attention_wg; a decode-shaped one
    # (4 rows a KV head: its _h8 build) and a split one and an INT8 cache's stay on attention_prefill.cu and
    # attention_decode.cu. Each result is checked.
    rng = np.random.default_rng(seed_of("wg-routing"))
    cases = [(PagedBatch(rng, [(100, 100)], 32, 8, 64), 1, ["attention_wg"]),
             (PagedBatch(rng, [(1, 300), (1, 50)], 32, 8, 64), 1, ["attention_decode_h8"]),
             (PagedBatch(rng, [(1, 300), (1, 50)], 32, 8, 64), 4, ["attention_decode_h8", "attention_combine"]),
             (PagedBatch(rng, [(100, 1100)], 32, 8, 64), 4, ["attention", "attention_combine"]),
             (PagedBatch(rng, [(100, 100)], 32, 8, 64, int8=True), 1, ["attention_int8"])]
    for batch, num_splits, want in cases:
        with kernels_launched() as names:
            got = batch.run(buf, stream, num_splits)
        assert names == want, f"{batch.label(num_splits)}: launched {names}, expected {want}"
        check_attention(got, batch.reference(), batch.vmax, batch.label(num_splits) + " routed")


# ----------------------------------------------------------------------------- the whole model
def model_logits(path, ids, chunks, wg: bool) -> tuple[list[np.ndarray], int, int]:
    """(logits per chunk size, attention_wg launches, layers) of one model load whose forward passes launch
    attention with wg=True (the default) or wg=False (attention_prefill.cu instead of attention_wg)."""
    with kernels_launched() as names, pytest.MonkeyPatch.context() as mp:
        # The forward calls tileinfer.kernels.attention at each launch: the same launcher, with wg set.
        mp.setattr(tileinfer.kernels, "attention", functools.partial(attention, wg=wg))
        with tileinfer.load_model(path, progress=False) as model:
            out = [model.logits(ids, chunk=c) for c in chunks]
            layers = model.config.num_hidden_layers
    return out, names.count("attention_wg"), layers


def compare_model(path, label):
    from test_model import compare_logits  # the tree's logits tolerances (max 0.1 std, mean 0.01 std)
    ids = np.random.default_rng(seed_of("wg-model", label)).integers(0, 151643, 300).tolist()
    # One prefill step of 256 then 44 (max_logit_rows), and chunks of 50 over cached pages. (No chunk of <= 16
    # tokens: those replay the extend graphs, whose launches do not go through Kernel.launch.)
    chunks = (None, 50)
    base, launched, _ = model_logits(path, ids, chunks, wg=False)
    assert launched == 0, f"{label}: wg=False still launched attention_wg {launched} times"
    got, launched, layers = model_logits(path, ids, chunks, wg=True)
    steps = 2 + 300 // 50
    assert launched >= steps * layers, f"{label}: {launched} launches of attention_wg, expected >= {steps * layers}"
    for c, g, b in zip(chunks, got, base):
        err = np.abs(g - b) / b.std(axis=1, keepdims=True)
        print(f"{label}, chunk {c}: attention_wg vs attention_prefill.cu logits: max |diff|/std {err.max():.4f}, "
              f"mean {err.mean():.5f}")
        compare_logits(g, b, f"{label}, chunk {c}: attention_wg vs attention_prefill.cu")


def test_attention_wg_model_logits_tiny(tiny_checkpoint):
    # The tiny preset: 4 query heads over 2 KV heads (G = 2), 2 layers, prefill in chunks over cached pages.
    compare_model(tiny_checkpoint, "tiny (G=2)")


def test_attention_wg_model_logits_g4(tmp_path_factory):
    # The tiny shapes with 8 query heads over 2 KV heads (G = 4, as qwen3-4b and qwen3-8b).
    from tileinfer.model.config import preset
    from tileinfer.model.synthetic import write_checkpoint
    out = tmp_path_factory.mktemp("tiny-g4")
    write_checkpoint(dataclasses.replace(preset("tiny"), num_attention_heads=8, num_key_value_heads=2), out,
                     seed=1, progress=False)
    compare_model(out, "tiny (G=4)")
