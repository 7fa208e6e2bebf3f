"""kernels.mlp_flow: an MLP's up and down products at 3-64 rows on gemm_swap.cu's flow builds, where the down
product's blocks start on each chunk of the up product's output as soon as it is written (counted in flags),
instead of after the whole up product.

The flow changes when the down product reads each chunk, not what it computes: h and the residual stream must come
back byte for byte as from the two plain swap-AB products, and the counts zero again after every call. The shapes
cover an up product of more than one wave of blocks (qwen3-4b's gate/up at 64 rows: 304 blocks for 264 slots, so
that down blocks run while up blocks still do), split and unsplit producers and consumers, Apertus' xIELU, an
intermediate size whose last chunk is partial, and deep consumers; at 3-32 rows with the norm statistics, as the
engine runs them (the builds are the roles it launches). Inputs are fresh random bf16 (seeded per case).
"""
from __future__ import annotations

import numpy as np
import pytest

from tileinfer.cuda import DeviceArray, Graph
from tileinfer.kernels import linear, mlp_flow
from tileinfer.kernels._check import BF16
from tileinfer.kernels.routing import SWAP_BK

from gpu_helpers import linear_weight, rand_bf16, seed_of  # noqa: E402

pytestmark = pytest.mark.gpu

XIELU_PARAMS = np.array([0.8, 1.3, 0.5, -1e-6], np.float32)  # [a_p, a_n, beta, eps] as the kernels take them


def setup(buf, M: int, D: int, I: int, epilogue: str):
    rng = np.random.default_rng(seed_of("mlp flow", M, D, I, epilogue))
    N_up = 2 * I if epilogue == "silu_mul" else I
    x = buf.upload(rand_bf16(rng, (M, D)))
    w_up, w_down = buf.upload(linear_weight(N_up, D)), buf.upload(linear_weight(D, I))
    act = buf.upload(XIELU_PARAMS) if epilogue == "xielu" else None
    old = rng.standard_normal((M, D), dtype=np.float32)
    return rng, x, w_up, w_down, act, old


def plain(buf, stream, x, w_up, w_down, act, old, epilogue):
    """h and the new residual rows from the two products on the plain swap-AB builds."""
    M, I = x.shape[0], w_down.shape[1]
    h, resid = buf.poisoned((M, I), BF16), buf.upload(old)
    linear(x, w_up, h, epilogue, stream, force="swap", act=act)
    linear(h, w_down, resid, "residual", stream, force="swap")
    return h.to_host(stream), resid.to_host(stream)


@pytest.mark.parametrize("M, D, I, epilogue", [
    (64, 2560, 9728, "silu_mul"),   # qwen3-4b: up 304 blocks (more than a wave), down split 4 ways
    (33, 1024, 3072, "silu_mul"),   # qwen3-0.6b: up split 2 ways, down 8
    (48, 1024, 1000, "silu_mul"),   # a partial last chunk (1000 = 15 x 64 + 40) and a partial last tile
    (64, 4096, 21504, "xielu"),     # apertus-8b: up 336 blocks, one tile a chunk
    (40, 512, 200, "xielu"),        # few blocks, a partial last chunk
], ids=lambda v: str(v))
def test_the_flow_gives_the_plain_products_bytes(M, D, I, epilogue, buf, stream):
    """At 33-64 rows (no norm statistics): h and the residual stream as from the two plain products."""
    _, x, w_up, w_down, act, old = setup(buf, M, D, I, epilogue)
    want_h, want_resid = plain(buf, stream, x, w_up, w_down, act, old, epilogue)
    flags = DeviceArray.zeros((-(-I // SWAP_BK) + 1,), np.int32)
    try:
        for attempt in range(3):  # the counts are back at zero after each call
            h, resid = buf.poisoned((M, I), BF16), buf.upload(old)
            mlp_flow(x, w_up, h, w_down, resid, epilogue, flags, stream, act=act)
            label = f"M={M} D={D} I={I} {epilogue}, call {attempt}"
            assert h.to_host(stream).tobytes() == want_h.tobytes(), f"{label}: h differs from the plain product's"
            assert resid.to_host(stream).tobytes() == want_resid.tobytes(), f"{label}: the residual stream differs"
            assert not flags.to_host(stream).any(), f"{label}: counts left behind"
    finally:
        flags.free()


def test_the_flow_replayed_from_a_graph_reads_each_replays_input(buf, stream):
    """Captured once, replayed with new x each time (as a decode step's graph is): the plain products' bytes each
    time, and the counts zero after each replay."""
    M, D, I, epilogue = 64, 2560, 9728, "silu_mul"
    rng, x, w_up, w_down, act, old = setup(buf, M, D, I, epilogue)
    h, resid = buf.poisoned((M, I), BF16), buf.upload(old)
    flags = DeviceArray.zeros((-(-I // SWAP_BK) + 1,), np.int32)
    mlp_flow(x, w_up, h, w_down, resid, epilogue, flags, stream, act=act)  # eager first: the kernels are loaded
    stream.synchronize()
    graph = Graph(stream, lambda s: mlp_flow(x, w_up, h, w_down, resid, epilogue, flags, s, act=act), "mlp flow")
    try:
        for replay in range(5):
            x.copy_from_host(rand_bf16(rng, (M, D)), stream)
            resid.copy_from_host(old, stream)
            graph.launch(stream)
            want_h, want_resid = plain(buf, stream, x, w_up, w_down, act, old, epilogue)
            assert h.to_host(stream).tobytes() == want_h.tobytes(), f"replay {replay}: h differs"
            assert resid.to_host(stream).tobytes() == want_resid.tobytes(), f"replay {replay}: resid differs"
            assert not flags.to_host(stream).any(), f"replay {replay}: counts left behind"
    finally:
        graph.destroy()
        flags.free()



@pytest.mark.parametrize("M, D, I, epilogue, last", [
    (16, 2560, 9728, "silu_mul", False),   # qwen3-4b at 16 rows: up 304 blocks on the consumer build of the statistics
    (32, 1024, 3072, "silu_mul", False),   # qwen3-0.6b at 32 rows
    (5, 4096, 12288, "silu_mul", False),   # qwen3-8b's verify step (k = 4): the down product on a deep build
    (24, 512, 200, "xielu", False),        # a partial last chunk
    (16, 2560, 9728, "silu_mul", True),    # the last layer: the up product's statistics, no next layer's
    (29, 4096, 12288, "silu_mul", False),  # the B = 32 builds (qwen3-8b): up 384 blocks
    (16, 4096, 12288, "silu_mul", True),   # qwen3-8b's last layer at 16 rows: the plain down product on a deep build
    (3, 1024, 3072, "silu_mul", False),    # the fewest rows
], ids=lambda v: str(v))
def test_the_flow_with_the_norm_statistics_gives_the_plain_products_bytes(M, D, I, epilogue, last, buf, stream):
    """At 3-32 rows the up product scales its rows by the statistics o_proj wrote (row_norm) and the down product
    writes the next layer's normed input and statistics (norm_out), which is also what the up product read: the
    bytes of h, the residual stream, next_x and its statistics as from the plain _nc and _np products."""
    rng, x, w_up, w_down, act, old = setup(buf, M, D, I, epilogue)
    ss_in = buf.upload(rng.uniform(0.5, 2.0, (M, -(-D // 64))).astype(np.float32) * np.float32(D / -(-D // 64)))
    next_w = buf.upload(rand_bf16(rng, (D,), scale=0.1, mean=1.0))
    eps = 1e-6

    def run(flow: bool):
        h, resid = buf.poisoned((M, I), BF16), buf.upload(old)
        x_in = buf.upload(x.to_host(stream))  # the down product's norm_out writes the up product's input
        norm_out = None if last else (next_w, x_in, buf.poisoned((M, -(-D // 64)), np.float32))
        if flow:
            flags = DeviceArray.zeros((-(-I // SWAP_BK) + 1,), np.int32)
            mlp_flow(x_in, w_up, h, w_down, resid, epilogue, flags, stream, act=act, row_norm=(ss_in, eps),
                     norm_out=norm_out)
            left = flags.to_host(stream)
            flags.free()
            assert not left.any(), "counts left behind"
        else:
            linear(x_in, w_up, h, epilogue, stream, force="swap", act=act, row_norm=(ss_in, eps))
            linear(h, w_down, resid, "residual", stream, force="swap", norm_out=norm_out)
        out = [h.to_host(stream), resid.to_host(stream), x_in.to_host(stream)]
        return out + ([] if last else [norm_out[2].to_host(stream)])

    for name, got, want in zip(("h", "the residual stream", "next_x", "the statistics"), run(True), run(False)):
        assert got.tobytes() == want.tobytes(), f"M={M} D={D} I={I} {epilogue}: {name} differs from the plain products'"
