"""Pool sizing from NVML free memory, the start-up report, and no out-of-memory afterwards.

These read the real NVML of the test GPU (nothing is mocked). The big-model cases write
synthetic qwen3-4b / qwen3-8b checkpoints once (cached under $TILEINFER_CHECKPOINTS).
"""
from __future__ import annotations

import numpy as np
import pytest

from tileinfer import LLM, SamplingParams
from tileinfer.cuda import pci_bus_id
from tileinfer.kv import sizing
from tileinfer.model.synthetic import cached_checkpoint

pytestmark = pytest.mark.gpu


def check_report(llm: LLM, utilization: float) -> None:
    r = llm.memory_report
    print("\n" + r.format())
    free, total, used = sizing.nvml_memory(pci_bus_id=pci_bus_id(0))
    assert r.total == total
    # The parts add up to what NVML sees, within 2% of the memory in use.
    assert abs(r.unaccounted) <= 0.02 * r.used, f"unaccounted {r.unaccounted / 2**30:.2f} GiB of {r.used / 2**30:.2f}"
    assert abs(used - r.used) <= 0.02 * r.used  # nothing allocated since start-up
    assert r.kv_pages == llm.runner.cache.layout.num_pages and r.kv_pool == llm.runner.cache.layout.nbytes
    # The pool used the budget: what is free now is about (1 - u) x total plus the graph reserve.
    assert used <= utilization * total + 2**30
    assert used >= utilization * total - 2 * 2**30


def test_pool_is_sized_from_nvml_and_report_adds_up(tiny_checkpoint):
    with LLM(tiny_checkpoint, max_num_seqs=32, max_context=2048, gpu_memory_utilization=0.5, progress=False) as llm:
        check_report(llm, 0.5)
        out = llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert all(len(o.token_ids) == 4 for o in out)


def test_too_little_memory_is_refused_with_the_setting_to_change(tiny_checkpoint):
    with pytest.raises(ValueError, match="gpu_memory_utilization") as e:
        LLM(tiny_checkpoint, max_num_seqs=8, gpu_memory_utilization=0.001, progress=False)
    assert "GB more memory" in str(e.value)
    with pytest.raises(ValueError, match="num_pages=3 cannot hold one sequence"):
        LLM(tiny_checkpoint, max_num_seqs=8, max_context=1024, num_pages=3, progress=False)


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-8b"])
def test_full_batch_and_largest_chunk_fit_at_095(name):
    path = cached_checkpoint(name)
    with LLM(path, max_num_seqs=256, max_context=4096, gpu_memory_utilization=0.95,
             max_num_batched_tokens=4096, progress=False) as llm:
        check_report(llm, 0.95)
        rng = np.random.default_rng(0)
        # 255 short requests decode together while a 3,000-token prompt is prefilled beside
        # them in one chunk: a full decode batch and a full token budget in one step.
        prompts = [rng.integers(0, 151643, 16).tolist() for _ in range(255)]
        prompts.append(rng.integers(0, 151643, 3000).tolist())
        params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 255 + \
                 [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)]
        outs = llm.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == [8] * 255 + [2]
        assert llm.stats.graph_steps > 0


def test_int8_pool_holds_19x_the_positions_of_bf16(tiny_checkpoint):
    # The same budget (half the GPU), BF16 and then INT8: 2 x 128 bytes per vector against 128 + 4.
    positions = {}
    for kv in (None, "int8"):
        with LLM(tiny_checkpoint, max_num_seqs=8, max_context=2048, gpu_memory_utilization=0.5, kv_quantize=kv,
                 progress=False) as llm:
            check_report(llm, 0.5)
            assert llm.memory_report.kv_dtype == (kv or "bf16")
            positions[kv] = llm.runner.cache.capacity
    ratio = positions["int8"] / positions[None]
    print(f"pool positions at 0.5 of the GPU: BF16 {positions[None]:,}, INT8 {positions['int8']:,} ({ratio:.3f}x)")
    assert ratio >= 1.9
