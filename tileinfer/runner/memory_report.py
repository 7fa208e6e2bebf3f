"""The start-up memory report: where the device memory went, checked against NVML.

Every part is either our own allocation (summed from the DeviceArrays we made) or an NVML
difference measured around one start-up stage:

    in use before      NVML used before this engine made anything (other processes, the driver,
                       earlier engines in this process)
    CUDA context       NVML used after the primary context is created - before
    weights            DeviceArray bytes of the weights
    workspace          DeviceArray bytes of the activation buffers and step buffers
    kernels            NVML difference over the warm-up once its temporary cache is freed (the
                       loaded modules)
    graphs             NVML difference over capturing every decode graph
    KV pool            DeviceArray bytes of the pages
    draft model        speculative decoding only: the draft's DeviceArrays (weights, workspace, step
                       buffers, its pool) and the NVML difference over capturing its graphs
    free               NVML free after start-up

`unaccounted` is NVML's used minus the sum of the parts: allocator granularity, and anything
that was not measured. It should be small; the GPU tests hold it under 2% of the total.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 1024**3


@dataclass(frozen=True)
class MemoryReport:
    total: int
    used_before: int
    context: int
    weights: int
    workspace: int
    kernels: int
    graphs: int
    kv_pool: int
    free: int
    kv_dtype: str
    kv_pages: int
    kv_positions: int
    page_size: int
    max_context: int
    gpu_memory_utilization: float | None  # None when the pool was sized explicitly
    draft: int = 0  # the draft model's memory (speculative decoding), 0 without one

    @property
    def used(self) -> int:
        """NVML used at the end of start-up."""
        return self.total - self.free

    @property
    def parts(self) -> int:
        return (self.used_before + self.context + self.weights + self.workspace + self.kernels + self.graphs
                + self.kv_pool + self.draft)

    @property
    def unaccounted(self) -> int:
        return self.used - self.parts

    @property
    def sequences_of_max_context(self) -> int:
        return self.kv_pages // -(-self.max_context // self.page_size)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(used=self.used, unaccounted=self.unaccounted)
        return d

    def format(self) -> str:
        def gb(n: int) -> str:
            return f"{n / GiB:8.2f} GiB"

        sizing = (f"{self.gpu_memory_utilization:.2f} of total" if self.gpu_memory_utilization is not None
                  else "explicit")
        lines = [
            f"GPU memory at start-up ({sizing}; total {self.total / GiB:.2f} GiB, NVML):",
            f"  in use before     {gb(self.used_before)}",
            f"  CUDA context      {gb(self.context)}",
            f"  weights           {gb(self.weights)}",
            f"  workspace         {gb(self.workspace)}   activations, logits, step buffers",
            f"  kernels           {gb(self.kernels)}   loaded modules",
            f"  graphs            {gb(self.graphs)}   every decode graph",
            f"  KV pool           {gb(self.kv_pool)}   {self.kv_pages} pages x {self.page_size} = "
            f"{self.kv_positions:,} positions, {self.kv_dtype.upper()}; "
            f"{self.sequences_of_max_context} sequences of {self.max_context}",
        ]
        if self.draft:
            lines.append(f"  draft model       {gb(self.draft)}   weights, workspace, its pool and graphs")
        lines += [
            f"  unaccounted       {gb(self.unaccounted)}",
            f"  free              {gb(self.free)}",
        ]
        return "\n".join(lines)
