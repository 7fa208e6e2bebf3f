"""Which kernel attention() runs for each shape, cache kind, split and GPU (tileinfer.kernels.routing.kernel_name),
that the launcher's constants for cuda_src/attention_wg.cu, attention.cuh and attention_combine.cu match the
kernels' own, that the decode builds' registers (as this machine's NVRTC assembles them) and shared memory fit the
blocks an SM the splits count on, and how many key-range splits a decode or verify step gets (GPURunner._splits_for,
verify_splits). CPU only."""
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tileinfer.cuda.compiler import assembler_log, compile_source, cuda_src_dir, part_defines
from tileinfer.kv.paged_cache import CacheLayout
from tileinfer.model.inputs import StepShape
from tileinfer.runner.gpu import GPURunner
from tileinfer.kernels import routing
from tileinfer.kernels.attention import WG_KEY_TILE, WG_ROWS, WG_SMEM, WG_STAGES, WG_THREADS
from tileinfer.kernels.routing import kernel_file, kernel_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import ptxas_report  # noqa: E402 (scripts/ptxas_report.py: the assembler log's entry points and registers)

# The module (the package's `attention` attribute is the launcher function of the same name).
attention_module = importlib.import_module("tileinfer.kernels.attention")
SMALL_POOL = 1000 * 8 * 16 * 128  # pages x KV heads x page size x head_dim


def name(*, int8=False, keys_mode=False, num_splits=1, pool_elements=SMALL_POOL, arch="sm_90", **rows) -> str:
    return kernel_name(int8=int8, keys_mode=keys_mode, num_splits=num_splits, pool_elements=pool_elements, arch=arch,
                       **rows)


def test_hopper_prefill_over_bf16_without_a_split_takes_attention_wg():
    assert name() == "attention_wg"


def test_wg_false_keeps_attention_cu():
    # What the GPU tests compare attention_wg against: the same launch on attention_prefill.cu.
    assert name(wg=False) == "attention"
    assert name(wg=False, keys_mode=True, rows=4) == "attention_decode_h8"  # nothing else changes
    assert name(wg=False, int8=True) == "attention_int8"


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100", "sm_120"])
def test_other_gpus_keep_attention_cu(arch):
    assert name(arch=arch) == "attention"
    assert name(arch=arch, keys_mode=True) == "attention_decode"


def test_everything_else_stays_on_attention_cu():
    assert name(keys_mode=True) == "attention_decode"
    assert name(keys_mode=True, num_splits=4) == "attention_decode"
    assert name(num_splits=2) == "attention"                       # a split prefill-shaped launch
    assert name(int8=True) == "attention_int8"
    assert name(int8=True, keys_mode=True) == "attention_int8_decode"
    assert name(pool_elements=1 << 32) == "attention"               # past attention_wg's 32-bit offsets
    assert name(pool_elements=(1 << 32) - 128) == "attention_wg"


def test_decode_blocks_of_at_most_8_rows_take_the_h8_builds():
    # A decode step of a group <= 8 (one token per sequence) has one row tile of <= 8 rows: the _h8 build.
    for rows in (1, 2, 4, 8):
        assert name(keys_mode=True, rows=rows) == "attention_decode_h8"
        assert name(keys_mode=True, rows=rows, int8=True, num_splits=33) == "attention_int8_decode_h8"
        assert name(keys_mode=True, rows=rows, fused=True) == "attention_decode_h8_fused"
        assert name(keys_mode=True, rows=rows, int8=True, fused=True) == "attention_int8_decode_h8_fused"
    assert name(keys_mode=True, rows=9) == "attention_decode"        # e.g. verify steps: 16-row tiles
    assert name(keys_mode=True, rows=20, int8=True) == "attention_int8_decode"
    assert name(rows=4) == "attention_wg"                              # the prefill shape has no _h8 build
    assert name(rows=4, int8=True) == "attention_int8"


def test_decode_steps_past_a_wave_take_the_persistent_build():
    # attention_decode_h8_items where the plain _h8 grid (one block a sequence, split and KV head) exceeds a wave of
    # DECODE_ITEMS_BLOCKS blocks an SM; its grid is that wave.
    wave = routing.DECODE_ITEMS_BLOCKS * 132
    assert routing.decode_items_blocks("attention_decode_h8", wave + 1, 132) == wave
    assert routing.decode_items_blocks("attention_decode_h8", 256 * 8, 132) == wave   # qwen3-4b at batch 256
    assert routing.decode_items_blocks("attention_decode_h8", wave, 132) == 0        # one wave: the plain grid
    for other in ("attention_decode", "attention_int8_decode_h8", "attention_decode_h8_fused", "attention_wg"):
        assert routing.decode_items_blocks(other, 10 * wave, 132) == 0


def test_persistent_build_shared_memory_matches_the_launcher(tmp_path, monkeypatch):
    # ITEMS_SMEM is ItemsSmem::TOTAL, and DECODE_ITEMS_BLOCKS blocks of it fit an SM (228 KB, 1 KB reserved a block).
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path))
    want = attention_module.ITEMS_SMEM
    source = f'#include "attention.cuh"\nstatic_assert(ItemsSmem::TOTAL == {want}, "ItemsSmem");\n'
    compile_source("attention_items_smem.cu", source, "sm_90a", None, cuda_src_dir())
    assert routing.DECODE_ITEMS_BLOCKS * (want + 1024) <= 228 * 1024
    assert routing.DECODE_ITEMS_BLOCKS * (attention_module.smem_bytes(False, True, True) + 1024) <= 228 * 1024


def test_launch_constants_match_the_kernel(tmp_path, monkeypatch):
    # The launcher's block size, rows per block, key tile and dynamic shared memory are attention_wg.cu's.
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path))
    source = (f'#include "attention_wg.cu"\n'
              f'static_assert(THREADS == {WG_THREADS} && ROWS == {WG_ROWS} && KT == {WG_KEY_TILE}, "shape");\n'
              f'static_assert(WgSmem<{WG_STAGES}>::TOTAL == {WG_SMEM}, "shared memory");\n')
    compile_source("attention_wg_constants.cu", source, "sm_90a", None, cuda_src_dir())
    assert WG_SMEM <= 227 * 1024  # the opt-in maximum a block may have on Hopper


def test_attention_shared_memory_matches_the_launcher(tmp_path, monkeypatch):
    # smem_bytes (what attention() asks for) is Smem<Q8, KEYS, HALF>::TOTAL in attention.cuh for every build.
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path))
    checks = []
    for int8 in (False, True):
        for keys in (False, True):
            for half in ((False, True) if keys else (False,)):
                want = attention_module.smem_bytes(int8, keys, half)
                checks.append(f'static_assert(Smem<{str(int8).lower()}, {str(keys).lower()}, {str(half).lower()}>'
                              f'::TOTAL == {want}, "Smem<{int8}, {keys}, {half}>");')
    source = '#include "attention.cuh"\n' + "\n".join(checks) + "\n"
    compile_source("attention_smem_constants.cu", source, "sm_90a", None, cuda_src_dir())


# Hopper's (sm_90) limits an SM: the assembler's registers decide how many blocks fit beside the shared memory.
SM_REGISTERS, SM_SUB_PARTITIONS, REGISTER_UNIT = 65536, 4, 256  # registers go to a warp in units of 256
SM_SHARED, BLOCK_RESERVED, SM_THREADS = 228 * 1024, 1024, 2048
DECODE_THREADS = 128  # the decode builds' block (attention.cuh's THREADS; the launcher's)


def blocks_an_sm(registers: int, threads: int, shared: int) -> int:
    """Resident blocks an SM for a kernel of `registers` a thread, `threads` a block and `shared` bytes of shared
    memory a block, as CUDA's occupancy calculator counts them for sm_90: a warp's registers rounded up to the
    allocation unit, each of the four sub-partitions holding the warps its quarter of the register file fits."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    warps = SM_REGISTERS // SM_SUB_PARTITIONS // per_warp * SM_SUB_PARTITIONS
    return min(warps // (threads // 32), SM_SHARED // (shared + BLOCK_RESERVED), SM_THREADS // threads)


def test_blocks_an_sm_follows_the_occupancy_rules():
    assert blocks_an_sm(128, 128, 0) == 4 and blocks_an_sm(129, 128, 0) == 3   # 4,096 / 4,352 registers a warp
    assert blocks_an_sm(168, 128, 0) == 3 and blocks_an_sm(169, 128, 0) == 2
    assert blocks_an_sm(32, 128, 100 * 1024) == 2 and blocks_an_sm(32, 128, 0) == 16
    assert blocks_an_sm(255, 128, 0) == 2 and blocks_an_sm(64, 1024, 0) == 1


def test_decode_builds_registers_fit_the_blocks_an_sm_the_splits_count_on(tmp_path, monkeypatch):
    # The decode splits (GPURunner._splits_for) and the persistent build's wave count on these blocks an SM; a build
    # whose registers grew past them would run its grid in two waves with every value still right. The registers
    # are this machine's NVRTC's (tests/gpu/test_int8_kernels.py asks the GPU's occupancy API the same).
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path))
    used = {entry.name: entry.registers for defines in part_defines("attention_decode.cu")
            for entry in ptxas_report.parse_log("attention_decode.cu",
                                                assembler_log("attention_decode.cu", "sm_90a", defines))}
    bf16_h8 = attention_module.smem_bytes(False, True, True)
    wants = {"attention_decode_h8": (bf16_h8, routing.DECODE_ITEMS_BLOCKS),
             "attention_decode_h8_fused": (bf16_h8, routing.DECODE_ITEMS_BLOCKS),
             "attention_decode_h8_items": (attention_module.ITEMS_SMEM, routing.DECODE_ITEMS_BLOCKS),
             "attention_decode": (attention_module.smem_bytes(False, True), 2),
             "attention_int8_decode_h8": (attention_module.smem_bytes(True, True, True), routing.int8_decode_blocks(4)),
             "attention_int8_decode_h8_fused": (attention_module.smem_bytes(True, True, True),
                                                routing.int8_decode_blocks(4)),
             "attention_int8_decode": (attention_module.smem_bytes(True, True), routing.int8_decode_blocks(16))}
    assert set(used) == set(wants), f"attention_decode.cu's entry points changed: {sorted(used)}"
    for name, (shared, want) in wants.items():
        got = blocks_an_sm(int(used[name]), DECODE_THREADS, shared)
        assert got == want, f"{name}: {used[name]} registers, {shared} bytes of shared memory fit {got} blocks an " \
                            f"SM; the decode splits count on {want}"


def test_combine_constants_match_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path))
    source = ('#include "attention_combine.cu"\n'
              f'static_assert(COMBINE_MAX_SPLITS == {attention_module.MAX_SPLITS}, "splits");\n'
              f'static_assert(COMBINE_WARPS * 32 == {attention_module.COMBINE_THREADS}, "threads");\n')
    compile_source("attention_combine_constants.cu", source, "sm_90a", None, cuda_src_dir())


@pytest.mark.parametrize("name, file", [
    ("attention_wg", "attention_wg.cu"), ("attention", "attention_prefill.cu"),
    ("attention_int8", "attention_prefill.cu"), ("attention_decode", "attention_decode.cu"),
    ("attention_int8_decode", "attention_decode.cu"), ("attention_decode_h8", "attention_decode.cu"),
    ("attention_int8_decode_h8", "attention_decode.cu"), ("attention_decode_h8_fused", "attention_decode.cu"),
    ("attention_int8_decode_h8_fused", "attention_decode.cu"), ("attention_combine", "attention_combine.cu")])
def test_each_kernel_loads_from_its_file(name, file):
    assert kernel_file(name) == file
    assert (cuda_src_dir() / file).is_file()


def test_every_routed_kernel_has_a_file_that_exports_it():
    # Each name kernel_name can return is an entry point of the file kernel_file names (the symbol in its source).
    names = {kernel_name(int8=int8, keys_mode=keys, num_splits=splits, pool_elements=SMALL_POOL, arch=arch, rows=rows)
             for int8 in (False, True) for keys in (False, True) for splits in (1, 4) for arch in ("sm_90", "sm_80")
             for rows in (4, 16)}
    assert len(names) == 7, names
    for n in names | {"attention_combine", "attention_decode_h8_items"}:
        source = (cuda_src_dir() / kernel_file(n)).read_text()
        assert f"ATTENTION_KERNEL({n}," in source or f" {n}(" in source, f"{n} is not in {kernel_file(n)}"


class _FakeModel:
    """What GPURunner._splits_for reads: the SM count, the heads this GPU holds (local_config: a tensor-parallel
    rank's share), the attached cache's kind."""

    def __init__(self, int8: bool, heads: int = 32, kv_heads: int = 8):
        self.device = SimpleNamespace(info=SimpleNamespace(num_sms=132))
        self.local_config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
        self.cache = SimpleNamespace(int8=int8)


@pytest.mark.parametrize("int8, heads, kv_heads, batch, want", [
    (False, 32, 8, 1, 33), (False, 32, 8, 8, 4), (False, 32, 8, 16, 2), (False, 32, 8, 32, 1), (False, 32, 8, 64, 1),
    (True, 32, 8, 1, 48), (True, 32, 8, 8, 8), (True, 32, 8, 16, 4), (True, 32, 8, 64, 1),  # _h8: 4 blocks an SM
    (True, 32, 2, 1, 48), (True, 32, 2, 8, 24), (True, 32, 2, 16, 12), (True, 32, 2, 64, 3)])  # 16-row build: 3
def test_decode_splits_fill_one_wave_of_the_kernels_blocks(int8, heads, kv_heads, batch, want):
    model = _FakeModel(int8, heads, kv_heads)
    assert GPURunner._splits_for(model, batch, 1 << 30) == want
    assert GPURunner._splits_for(model, batch, 5) == min(want, 5)  # at most one split a key tile


def _layer_weights(hidden: int, heads: int, kv_heads: int, intermediate: int, head_dim: int = 128):
    """A layer's matrices as GPURunner.decode_splits reads them: their bytes (bf16)."""
    def w(rows, cols):
        return SimpleNamespace(nbytes=2 * rows * cols)
    return SimpleNamespace(w_qkv=w((heads + 2 * kv_heads) * head_dim, hidden), w_o=w(hidden, heads * head_dim),
                           w_up=w(2 * intermediate, hidden), w_down=w(hidden, intermediate))


class _FakeDecoder(_FakeModel):
    """What GPURunner.decode_splits reads beyond _splits_for's: the mode, the longest context, the cache's layout,
    a layer's weights."""

    def __init__(self, int8: bool, max_context: int, *, hidden: int, heads: int, kv_heads: int, intermediate: int):
        super().__init__(int8, heads, kv_heads)
        self.local_config.head_dim = 128
        self.batch_invariant, self.max_context = False, max_context
        self.weights = SimpleNamespace(layers=[_layer_weights(hidden, heads, kv_heads, intermediate)])
        self.cache.layout = CacheLayout(num_layers=36, num_pages=1, num_kv_heads=kv_heads, page_size=64, head_dim=128,
                                        int8=int8)

    def _splits_for(self, *args):
        return GPURunner._splits_for(self, *args)


QWEN3_4B = dict(hidden=2560, heads=32, kv_heads=8, intermediate=9728)
QWEN3_06B = dict(hidden=1024, heads=16, kv_heads=8, intermediate=3072)


@pytest.mark.parametrize("model, int8, batch, context, want", [
    (QWEN3_4B, False, 1, 2176, 16),    # a layer's cache (9 MB) under a quarter of its weights (202 MB): one block an SM
    (QWEN3_4B, False, 1, 8320, 16),    # 34 MB, still under 50 MB
    (QWEN3_4B, False, 1, 16512, 33),   # 68 MB, over: two blocks an SM
    (QWEN3_4B, False, 1, 32896, 33),   # 135 MB
    (QWEN3_4B, False, 1, 640, 10),     # one split a key tile
    (QWEN3_4B, False, 2, 2176, 16),    # batch 2: two blocks an SM
    (QWEN3_4B, True, 1, 8320, 48),     # the INT8 cache: its kernel's blocks an SM
    (QWEN3_06B, False, 1, 1152, 16),   # 4.7 MB of cache under a quarter of 31 MB of weights
    (QWEN3_06B, False, 1, 2176, 33),   # 8.9 MB, over 7.9 MB: two blocks an SM
])
def test_decode_splits_take_one_bf16_block_an_sm_at_batch_1_over_a_short_cache(model, int8, batch, context, want):
    assert GPURunner.decode_splits(_FakeDecoder(int8, context, **model), batch) == want


class _FakeVerifier(_FakeModel):
    """What GPURunner.verify_splits reads beyond _splits_for's: the mode, the longest context, the partials."""

    def __init__(self, int8: bool, heads: int, kv_heads: int, *, max_context: int = 4096, partial_rows: int = 1 << 20,
                 batch_invariant: bool = False):
        super().__init__(int8, heads, kv_heads)
        self.batch_invariant, self.max_context = batch_invariant, max_context
        self.workspace = SimpleNamespace(max_partial_rows=partial_rows)

    def _splits_for(self, *args):
        return GPURunner._splits_for(self, *args)


@pytest.mark.parametrize("int8, H, KV, rows, width, context, want", [
    (False, 32, 8, 1, 16, 4096, 8),    # qwen3-8b, 15 drafts: 64 query rows, 4 row tiles a KV head, 2 blocks an SM
    (False, 32, 8, 1, 5, 4096, 16),    # k = 4: 20 rows, 2 row tiles
    (False, 32, 8, 8, 16, 4096, 1),    # 8 x 4 x 8 blocks fill the GPU already
    (False, 4, 2, 1, 16, 512, 8),      # the demo target: one split a key tile of its 512 positions
    (False, 4, 2, 1, 16, 4096, 48),    # at most MAX_SPLITS
    (True, 32, 8, 1, 16, 4096, 12),    # the INT8 16-row build: 3 blocks an SM
    (True, 32, 8, 2, 2, 4096, 33),     # 8 rows a sequence: the _h8 build, 4 an SM
    (False, 32, 8, 1, 17, 4096, 1),    # 68 rows: the prefill shape, which is not split
])
def test_verify_splits_fill_one_wave_of_the_decode_shape_blocks(int8, H, KV, rows, width, context, want):
    model = _FakeVerifier(int8, H, KV, max_context=context)
    shape = StepShape(num_tokens=rows * width, num_seqs=rows, max_q_len=width)
    assert GPURunner.verify_splits(model, shape) == want
    invariant = _FakeVerifier(int8, H, KV, max_context=context, batch_invariant=True)
    assert GPURunner.verify_splits(invariant, shape) == 1


def test_verify_splits_stay_within_the_workspace_partials():
    model = _FakeVerifier(False, 32, 8, partial_rows=40)
    assert GPURunner.verify_splits(model, StepShape(num_tokens=16, num_seqs=1, max_q_len=16)) == 2
    model = _FakeVerifier(False, 32, 8, partial_rows=10)
    assert GPURunner.verify_splits(model, StepShape(num_tokens=16, num_seqs=1, max_q_len=16)) == 1


@pytest.mark.parametrize("max_q_len, H, KV, splits, seqs, want", [
    (1, 32, 8, 48, 1, True),      # a decode step over a long cache (qwen3-4b at 32k: 48 splits)
    (1, 32, 8, 16, 1, True),
    (1, 32, 8, 15, 1, False),     # below FUSED_MIN_SPLITS: attn_input launched
    (1, 32, 8, 11, 1, False),     # 512 positions
    (1, 32, 8, 4, 4, True),       # a group of 4 (qwen3-4b, 8b): from 4 sequences (FUSED_SEQS)
    (1, 32, 8, 4, 3, False),
    (1, 32, 8, 10, 2, False),     # ... not at 2 below FUSED_MIN_SPLITS
    (1, 32, 8, 1, 256, True),     # up to 256
    (1, 32, 8, 1, 257, False),
    (1, 32, 8, 48, 512, True),    # a long cache fuses at any batch
    (2, 32, 8, 48, 1, False),     # two tokens a sequence: the queries of several positions
    (2, 32, 8, 1, 64, False),
    (1, 64, 4, 48, 1, False),     # a group of 16: the 16-row build, which has no fused input
    (1, 64, 4, 1, 64, False),
    (1, 16, 8, 48, 1, True),      # qwen3-0.6b's group of 2
    (1, 16, 8, 8, 2, True),       # a group of 2: 2-256 sequences
    (1, 16, 8, 1, 256, True),
    (1, 16, 8, 1, 257, False),
    (1, 16, 8, 11, 1, False),     # but not at batch 1 below FUSED_MIN_SPLITS
    (1, 24, 8, 4, 2, True),       # a group of 3 too
    (1, 64, 8, 4, 7, False),      # a group of 8 (qwen3-32b): 8-64 sequences
    (1, 64, 8, 4, 8, True),
    (1, 64, 8, 4, 64, True),
    (1, 64, 8, 4, 65, False),
])
def test_engine_fuses_the_attention_input_of_long_or_batched_decode_steps(max_q_len, H, KV, splits, seqs, want):
    got = routing.engine_fuses_input(max_q_len=max_q_len, num_heads=H, num_kv_heads=KV, num_splits=splits,
                                     num_seqs=seqs)
    assert got == want
    assert not routing.engine_fuses_input(max_q_len=1, num_heads=H, num_kv_heads=KV, num_splits=splits,
                                          num_seqs=seqs, decode_shape=False)
