"""How much memory the paged KV cache needs, and how much of it fits on a GPU.

Per cached position the cache holds a key and a value vector per layer and KV head:

    BF16:  2 x layers x kv_heads x head_dim x 2 bytes
    INT8:  2 x layers x kv_heads x (head_dim x 1 byte + 4 bytes)    one float32 scale per vector

(Qwen3-0.6B: 114,688 B = 112 KiB and 59,136 B = 57.75 KiB.) Pages are the unit of allocation:
a cache for n positions holds ceil(n / page_size) pages, and a sequence of context C needs
ceil(C / page_size) pages of its own.

What fits on a device: `gpu_memory_utilization` (u) is a fraction of the device's TOTAL memory,
as NVML reports it, and it caps what everything on the device may occupy together once the
engine is loaded. Memory that is already in use (other processes, the driver: NVML's total -
free) is subtracted, then the weights and a reserve for activations and the CUDA context:

    cache budget = floor(u x total) - used - weights - reserve
    pages        = floor(cache budget / bytes per page), at least 0

Why this definition:
  * The same u means the same thing on every GPU and whatever runs next to us: "leave
    (1 - u) x total free". A fraction of *free* memory would change meaning with the
    neighbours and could never be compared across runs.
  * The budget can never exceed free memory (floor(u x total) - used <= total - used), so a
    plan made from NVML is one the allocator can actually satisfy.
  * The (1 - u) x total headroom stays free whatever else is running: room for allocator
    fragmentation, the driver, or a neighbour that grows.
Older vLLM releases coded u the same way ("all allocations on the GPU may not exceed u of it");
current vLLM reads it as a per-instance share instead (it asks for u x total whatever others
use, and fails at start-up unless that much is free). With nothing else on the device the two
agree. With an explicit memory figure (`--gpu-memory`) nothing is in use (used = 0). An engine
that has already loaded its weights passes weights=0 to `plan`: NVML's used then counts them.

Pure arithmetic plus one NVML reader; nothing here touches the CUDA driver.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

KV_DTYPES = ("bf16", "int8")
DEFAULT_PAGE_SIZE = 64
DEFAULT_UTILIZATION = 0.9
# CUDA context (~0.5 GB on an H200), compiled kernels, the activation workspace (~0.3 GB for Qwen3-8B
# at 2,048-token prefill chunks, half of it 256 rows of float32 logits), step buffers and decode graphs.
DEFAULT_RESERVE_BYTES = 1_000_000_000
_SCALE_BYTES = 4  # one float32 scale per cached vector (one KV head at one position) in the INT8 cache


def _check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_non_negative(name: str, value, unit: str = "bytes") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative number of {unit}, got {value!r}")


def check_utilization(utilization) -> None:
    if not isinstance(utilization, (int, float)) or isinstance(utilization, bool) or not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1] (a fraction of the GPU's total memory), got {utilization!r}")


def bytes_per_position(config, kv_dtype: str = "bf16") -> int:
    """Cache bytes for one position: K and V of every layer and KV head."""
    _check_kv_dtype(kv_dtype)
    per_vector = config.head_dim * 2 if kv_dtype == "bf16" else config.head_dim + _SCALE_BYTES
    return 2 * config.num_hidden_layers * config.num_key_value_heads * per_vector


def bytes_per_page(config, page_size: int = DEFAULT_PAGE_SIZE, kv_dtype: str = "bf16") -> int:
    _check_positive_int("page_size", page_size)
    return page_size * bytes_per_position(config, kv_dtype)


def pages_for(positions: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """Pages that hold `positions` positions of one sequence (whole pages)."""
    _check_positive_int("positions", positions)
    _check_positive_int("page_size", page_size)
    return -(-positions // page_size)


def cache_bytes(config, positions: int, page_size: int = DEFAULT_PAGE_SIZE, kv_dtype: str = "bf16") -> int:
    """Bytes of a cache created for `positions` positions (ceil(positions / page_size) whole pages)."""
    return pages_for(positions, page_size) * bytes_per_page(config, page_size, kv_dtype)


def weight_bytes(config) -> int:
    """Bytes of the weights on the device: every parameter in bf16, a tied embedding counted once."""
    return 2 * config.num_parameters()


def pages_that_fit(budget_bytes: int, reserve_bytes: int, config, page_size: int = DEFAULT_PAGE_SIZE,
                   kv_dtype: str = "bf16") -> int:
    """floor((budget - reserve) / bytes per page), 0 when the reserve alone does not fit."""
    _check_non_negative("reserve_bytes", reserve_bytes)
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool):
        raise ValueError(f"budget_bytes must be an integer number of bytes, got {budget_bytes!r}")
    return max(0, (budget_bytes - reserve_bytes) // bytes_per_page(config, page_size, kv_dtype))


def sequences_that_fit(pages: int, context: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """How many sequences of `context` positions `pages` pages hold (each needs whole pages of its own)."""
    _check_non_negative("pages", pages, unit="pages")
    _check_positive_int("context", context)
    return pages // pages_for(context, page_size)


@dataclass(frozen=True, slots=True)
class SizingPlan:
    """The cache that fits in `total_bytes` at `utilization`, after what is in use, the weights and a reserve."""
    kv_dtype: str
    page_size: int
    total_bytes: int
    used_bytes: int            # already on the device: others, the driver (and our weights if weight_bytes is 0)
    utilization: float         # fraction of total_bytes everything together may occupy
    weight_bytes: int
    reserve_bytes: int
    pages: int
    sequences: dict[int, int]  # context length -> sequences of that length that fit

    @property
    def usable_bytes(self) -> int:
        """floor(utilization x total) - used: what the engine may allocate, weights included."""
        return math.floor(self.utilization * self.total_bytes) - self.used_bytes

    @property
    def cache_budget_bytes(self) -> int:
        """What is left for the pages (negative when the weights and reserve do not fit)."""
        return self.usable_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def positions(self) -> int:
        return self.pages * self.page_size


def plan(config, total_bytes: int, *, used_bytes: int = 0, utilization: float = DEFAULT_UTILIZATION,
         reserve_bytes: int = DEFAULT_RESERVE_BYTES, weights: int | None = None,
         page_size: int = DEFAULT_PAGE_SIZE, kv_dtype: str = "bf16", contexts=()) -> SizingPlan:
    """Pages, positions and sequences of each context that fit (see the module docstring).

    `weights` defaults to weight_bytes(config); pass 0 when they are already loaded, and so
    counted in `used_bytes`.
    """
    _check_kv_dtype(kv_dtype)
    check_utilization(utilization)
    _check_positive_int("total_bytes", total_bytes)
    _check_non_negative("used_bytes", used_bytes)
    if used_bytes > total_bytes:
        raise ValueError(f"used_bytes ({used_bytes}) exceeds total_bytes ({total_bytes})")
    weights = weight_bytes(config) if weights is None else weights
    _check_non_negative("weight_bytes", weights)
    usable = math.floor(utilization * total_bytes) - used_bytes
    pages = pages_that_fit(usable - weights, reserve_bytes, config, page_size, kv_dtype)
    sequences = {c: sequences_that_fit(pages, c, page_size) for c in contexts}
    return SizingPlan(kv_dtype, page_size, total_bytes, used_bytes, utilization, weights, reserve_bytes,
                      pages, sequences)


def nvml_memory(device_index: int = 0, pci_bus_id: str | None = None) -> tuple[int, int, int]:
    """(free, total, used) bytes of one GPU as NVML reports them; used = total - free (everything on it,
    other processes and the driver's own reservation included). `pci_bus_id` (as the CUDA driver
    names it, e.g. "0000:19:00.0") picks the GPU regardless of CUDA_VISIBLE_DEVICES; else NVML's index.

    Raises RuntimeError naming NVML's error when there is no driver, no GPU, or no such index.
    """
    try:
        import pynvml
    except ImportError as e:
        raise RuntimeError(f"NVML is not available: {e} (install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as e:
        raise RuntimeError(f"NVML could not start: {e} (is there an NVIDIA driver and a GPU?)") from None
    try:
        if pci_bus_id:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode() if isinstance(pci_bus_id, str)
                                                          else pci_bus_id)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        free, total = int(info.free), int(info.total)
        return free, total, total - free
    except (pynvml.NVMLError, OSError) as e:
        which = pci_bus_id or device_index
        raise RuntimeError(f"NVML could not read the memory of GPU {which}: {e}") from None
    finally:
        pynvml.nvmlShutdown()
