#!/usr/bin/env python3
"""The host side of one step's launches, on any machine (no GPU): model/forward.py's forward() with the
driver's launch replaced by a recorder.

    python3 scripts/host_launches.py --models qwen3-0.6b,qwen3-4b --tokens 512 --seqs 1 [--splits 1]
        [--repeats 50] [--profile 25] [--list]

What runs is the package's own Python for a step: forward(), the launchers in kernels/ with their checks and
routing, and Kernel.launch's packing of the arguments (module.pack_arguments: the array of their addresses
that the driver reads). What does not: cuLaunchKernelEx and the other driver calls. Device arrays
are addresses with no memory behind them, tensor maps are 128 zero bytes, and the occupancy queries answer the
H200's counts (132 SMs; clusters of 2, 3 and 4 blocks: 132, 117 and 120 blocks at once), so that the products
route as they do there. The runner's preparation of a step's inputs (runner/step.py) is not included.

Per model it prints the launches of a step of --tokens rows in --seqs sequences (prompts of equal length; a
decode step when they are equal; bf16 weights, a BF16 cache), the host time of a step and of a launch (the
median over --repeats steps), and a digest of the launch list (each launch's kernel, grid, block, shared memory
and arguments): a change to the launchers whose digest is unchanged launches exactly what the code before it
launched. A device pointer enters the digest as the allocation it points into (named by its size and by how many
allocations of that size came before it) and the offset there, not as an address, so that a change that adds a
buffer of another size (a workspace array) leaves the digests of the steps that do not use it as they were.
--profile N: the N functions with the most own time (cProfile) over the repeats. --list: every launch, in order.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import ctypes
import hashlib
import importlib
import io
import pstats
import statistics
import sys
import time
import types
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's package, when not installed
import tileinfer.cuda.driver as cuda_driver  # noqa: E402
import tileinfer.cuda.memory as cuda_memory  # noqa: E402
import tileinfer.cuda.module as cuda_module  # noqa: E402
import tileinfer.cuda.tensormap as cuda_tensormap  # noqa: E402
from tileinfer.model import forward as F  # noqa: E402
from tileinfer.model.config import preset  # noqa: E402
from tileinfer.model.inputs import StepInputs, StepShape  # noqa: E402

linear_module = importlib.import_module("tileinfer.kernels.linear")  # the module (tileinfer.kernels.linear is its function)

BF16 = np.dtype(ml_dtypes.bfloat16)
H200 = cuda_driver.DeviceInfo(ordinal=0, name="NVIDIA H200 (host launches only)", compute_capability=(9, 0),
                              num_sms=132, total_memory=143 << 30, max_shared_per_block_optin=232448,
                              l2_bytes=60 << 20)
H200_CLUSTER_BLOCKS = {2: 132, 3: 117, 4: 120}  # cluster_slots() on the H200: blocks of such clusters at once
PAGE_SIZE = 16


class Launch(tuple):
    """(kernel, grid, block, smem, its arguments as recorded, the bytes the driver would copy for them)."""

    def __str__(self) -> str:
        name, grid, block, smem, _, size = self
        return f"{name} grid={grid} block={block} smem={smem} args={size} bytes"


class Recorder:
    """Stands in for the driver below Kernel.launch: kernels whose launches are recorded (when `on`)."""

    def __init__(self):
        self.launches: list[Launch] = []
        self.on = True
        self._modules: dict[str, _Module] = {}
        self._next_address = 1 << 32
        self._starts: list[int] = []                # each allocation's address, in order (ascending)
        self._allocations: list[tuple[int, int]] = []  # its (bytes, how many allocations of that size came before)
        self._sizes: dict[int, int] = {}

    def module(self, filename: str) -> "_Module":
        if filename not in self._modules:
            self._modules[filename] = _Module(self)
        return self._modules[filename]

    def call(self, fn, *args, detail=None):
        """cuda_memory's driver calls: an allocation gets the next free address; copies do nothing."""
        if fn is cuda_driver.driver.cuMemAlloc:
            address, size = self._next_address, int(args[0])
            self._next_address += (size + 4095) // 4096 * 4096 + 4096
            self._starts.append(address)
            self._allocations.append((size, self._sizes.get(size, 0)))
            self._sizes[size] = self._sizes.get(size, 0) + 1
            return address
        return None

    def where(self, address: int) -> bytes | None:
        """An address inside an allocation named by that allocation (its size, and how many allocations of that
        size came before it) and the offset in it: the same name whatever else is allocated, and in what order.
        None for an address outside every allocation."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        size, nth = self._allocations[i]
        offset = address - self._starts[i]
        return f"<{size} bytes #{nth} +{offset}>".encode() if offset < max(size, 1) else None

    def argument(self, arg) -> bytes:
        """What a launch's digest takes of one argument: a device pointer (a DeviceArray's, or a 64-bit integer
        inside an allocation) as where(), a null pointer as such, any other value as its bytes."""
        if arg is None:
            return b"<null>"
        if isinstance(arg, cuda_memory.DeviceArray):
            return self.where(arg.ptr) or arg.ptr.to_bytes(8, "little")
        if isinstance(arg, ctypes.c_uint64):
            return self.where(arg.value) or bytes(arg)
        return ctypes.string_at(ctypes.addressof(arg), ctypes.sizeof(arg))


class _Module:
    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self._kernels: dict[str, _Kernel] = {}

    @property
    def names(self) -> list[str]:
        """The kernels looked up (launched, or asked for their occupancy) in this file, sorted."""
        return sorted(self._kernels)

    def kernel(self, name: str) -> "_Kernel":
        if name not in self._kernels:
            self._kernels[name] = _Kernel(name, self.recorder)
        return self._kernels[name]


class _Kernel:
    """Kernel's interface as the launchers use it."""

    def __init__(self, name: str, recorder: Recorder):
        self.name, self.recorder = name, recorder
        self.max_dynamic_smem = 0

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        self.max_dynamic_smem = max(self.max_dynamic_smem, nbytes)

    def prefer_shared_memory(self) -> None:
        pass

    def max_active_clusters(self, cluster: int, threads: int, smem: int) -> int:
        return H200_CLUSTER_BLOCKS[cluster] // cluster

    def max_active_blocks(self, threads: int, smem: int) -> int:
        return 1

    def launch(self, grid, block, args, stream, smem: int = 0) -> None:
        """Kernel.launch's host work up to the driver call: the arguments packed as it packs them."""
        grid = (*grid, 1, 1)[:3]
        block = (*block, 1, 1)[:3]
        if min(grid) <= 0:
            return
        cuda_module.pack_arguments(args)
        if self.recorder.on:
            size = sum(8 if a is None or isinstance(a, cuda_memory.DeviceArray) else ctypes.sizeof(a) for a in args)
            data = b"|".join(self.recorder.argument(a) for a in args)
            self.recorder.launches.append(Launch((self.name, grid, block, smem, data, size)))


class _Device:
    def __init__(self, ordinal: int = 0):
        self.info = H200


class _TensorMap:
    def __init__(self):
        self._bytes = (ctypes.c_uint8 * 128)()

    def getPtr(self) -> int:
        return ctypes.addressof(self._bytes)


@contextlib.contextmanager
def recording():
    """The package's driver-facing pieces replaced for the duration (and its caches of their answers emptied
    before and after): yields the Recorder."""
    recorder = Recorder()
    saved = [(cuda_module, "load_module"), (cuda_driver, "Device"), (cuda_tensormap, "call"), (cuda_memory, "call")]
    originals = [getattr(m, name) for m, name in saved]

    def clear_caches():
        cuda_driver.get_device.cache_clear()  # else the stand-in device outlives the recording
        cuda_tensormap.bf16_tensor_map.cache_clear()
        linear_module._tma_plan.cache_clear()
        linear_module._cluster_slots.clear()

    clear_caches()
    cuda_module.load_module = recorder.module
    cuda_driver.Device = _Device
    cuda_tensormap.call = lambda *a, **k: _TensorMap()
    cuda_memory.call = recorder.call
    try:
        yield recorder
    finally:
        for (m, name), value in zip(saved, originals):
            setattr(m, name, value)
        clear_caches()


class _Stream:
    handle = 0


def step_objects(model, tokens: int, seqs: int):
    """Weights, workspace, cache and inputs of `model`'s shapes (a preset's name, or a ModelConfig; addresses only;
    inside `recording`)."""
    c = preset(model) if isinstance(model, str) else model
    D, I, H, KV, hd = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def a(*shape, dtype=BF16):
        return cuda_memory.DeviceArray(shape, dtype)

    up_rows = 2 * I if c.mlp == "gated_silu" else I
    layers = [types.SimpleNamespace(input_norm=a(D), w_qkv=a((H + 2 * KV) * hd, D), q_norm=a(hd), k_norm=a(hd),
                                    w_o=a(D, H * hd), post_norm=a(D), w_up=a(up_rows, D), w_down=a(D, I),
                                    act=None if c.mlp == "gated_silu" else a(4, dtype=np.float32))
              for _ in range(c.num_hidden_layers)]
    weights = types.SimpleNamespace(config=c, layers=layers, embed=a(c.vocab_size, D), final_norm=a(D),
                                    lm_head=a(c.vocab_size, D))
    max_splits = 128
    ws = F.Workspace(c, tokens, seqs, max_splits, tokens * max_splits)
    pages = seqs * (tokens // seqs + PAGE_SIZE) // PAGE_SIZE + 1
    pools = [(a(pages, KV, PAGE_SIZE, hd), a(pages, KV, PAGE_SIZE, hd)) for _ in range(c.num_hidden_layers)]
    cache = types.SimpleNamespace(k_pool=lambda i: pools[i][0], v_pool=lambda i: pools[i][1],
                                  layer_scales=lambda i: None, layer_smoothing=lambda i: None)
    i32 = np.int32
    inputs = StepInputs(tokens=a(tokens, dtype=i32), token_src=a(tokens, dtype=i32), positions=a(tokens, dtype=i32),
                        slots=a(tokens, dtype=i32), cu_q=a(seqs + 1, dtype=i32), kv_lens=a(seqs, dtype=i32),
                        last_rows=a(seqs, dtype=i32), block_tables=a(seqs, pages, dtype=i32),
                        sampled=a(seqs, dtype=i32))
    return weights, ws, cache, inputs


def step_kernels(model, tokens: int, seqs: int, splits: int) -> dict[str, list[str]]:
    """The kernels one step of `model`'s shapes (a preset's name, or a ModelConfig) looks up, by cuda_src file."""
    with recording() as recorder:
        weights, ws, cache, inputs = step_objects(model, tokens, seqs)
        shape = StepShape(num_tokens=tokens, num_seqs=seqs, max_q_len=tokens // seqs)
        F.forward(weights, ws, cache, inputs, shape, all_logits=False, num_splits=splits, stream=_Stream())
        return {filename: module.names for filename, module in recorder._modules.items()}


def measure(model: str, tokens: int, seqs: int, splits: int, repeats: int, profile: int = 0) -> dict:
    """One model's step: its launches, the host time of a step and of a launch, the digest, and (profile > 0) the
    profile's text."""
    if tokens < 1 or seqs < 1 or tokens % seqs:
        raise ValueError(f"--tokens must be a positive multiple of --seqs, got {tokens} and {seqs}")
    with recording() as recorder:
        weights, ws, cache, inputs = step_objects(model, tokens, seqs)
        shape = StepShape(num_tokens=tokens, num_seqs=seqs, max_q_len=tokens // seqs)

        def step():
            F.forward(weights, ws, cache, inputs, shape, all_logits=False, num_splits=splits, stream=_Stream())

        step()
        launches = list(recorder.launches)
        recorder.on = False
        step()  # warm: every cache the launchers keep is filled
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        text = ""
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(repeats):
                step()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(profile)
            text = out.getvalue()
    us = statistics.median(seconds) * 1e6
    digest = hashlib.sha256(b"".join(repr(x[:4]).encode() + x[4] for x in launches)).hexdigest()[:16]
    return {"model": model, "tokens": tokens, "seqs": seqs, "splits": splits, "launches": launches,
            "step_us": us, "launch_us": us / len(launches), "digest": digest, "profile": text}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-0.6b,qwen3-4b", help="presets, comma-separated")
    p.add_argument("--tokens", type=int, default=512, help="the step's rows (512)")
    p.add_argument("--seqs", type=int, default=1, help="its sequences, tokens / seqs each (1)")
    p.add_argument("--splits", type=int, default=1, help="attention's key splits (1)")
    p.add_argument("--repeats", type=int, default=50, help="steps timed (50)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="the N functions with the most own time")
    p.add_argument("--list", action="store_true", help="every launch, in order")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    for model in args.models.split(","):
        try:
            r = measure(model, args.tokens, args.seqs, args.splits, args.repeats, args.profile)
        except ValueError as e:
            print(f"host_launches: {e}", file=sys.stderr)
            return 2
        print(f"{model}: {args.tokens} tokens in {args.seqs} sequences, {len(r['launches'])} launches, "
              f"{r['step_us']:,.0f} us of host time a step, {r['launch_us']:.1f} us a launch (median of "
              f"{args.repeats}); launches digest {r['digest']}")
        if args.list:
            for launch in r["launches"]:
                print(f"  {launch}")
        if r["profile"]:
            print(r["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
