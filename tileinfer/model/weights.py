"""Qwen3 and Apertus weights on the device, in the layout the kernels read.

Hugging Face tensors are uploaded unchanged in content, but some are stacked so that one
kernel reads them in one pass:
    w_qkv  [(H + 2 KV) * hd, D]  = [q_proj; k_proj; v_proj]
    w_up   [2 I, D]              = [gate_proj; up_proj]   Qwen3 (the SiLU-mul epilogue pairs row j with row I + j)
           [I, D]                = up_proj                Apertus (xIELU, ungated: one matrix where Qwen3 reads two)
Stacking is a row-offset copy into one allocation, so nothing is rearranged on the host. The
families' norms differ in name only (config.norm_names); Apertus' four xIELU scalars a layer go up
as `act`, float32, with the gains already through softplus (xielu_params).
Bytes go from the safetensors mmap through two pinned staging buffers (copy one while the
other uploads), which keeps the upload near PCIe speed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from cuda.bindings import driver

from ..cuda import DeviceArray, Event, PinnedBuffer, call
from .reference import softplus

log = logging.getLogger(__name__)
BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass
class LayerWeights:
    input_norm: DeviceArray      # [D]
    w_qkv: DeviceArray           # [(H + 2 KV) * hd, D]
    q_norm: DeviceArray          # [hd]
    k_norm: DeviceArray          # [hd]
    w_o: DeviceArray             # [D, H * hd]
    post_norm: DeviceArray       # [D]
    w_up: DeviceArray            # [2 I, D] = [gate; up] (gated SiLU) or [I, D] = up (xIELU)
    w_down: DeviceArray          # [D, I]
    act: DeviceArray | None      # [4] float32 xIELU parameters (xielu_params); None for the gated MLP


# The epilogue of each MLP kind's input product (config.mlp): kernels/linear.py.
MLP_EPILOGUES = {"gated_silu": "silu_mul", "xielu": "xielu"}


def mlp_input_tensors(config, prefix: str) -> tuple[str, ...]:
    """The tensors stacked into w_up for a layer (prefix "model.layers.N.")."""
    if config.mlp == "gated_silu":
        return prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"
    return (prefix + "mlp.up_proj.weight",)


def xielu_params(checkpoint, prefix: str) -> np.ndarray:
    """A layer's xIELU parameters as the kernels apply them (cuda_src/common.cuh): [a_p, a_n, beta, eps] with
    a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n), in float32 as model/reference.py's xielu."""
    alpha_p, alpha_n, beta, eps = (np.float32(np.asarray(checkpoint.read(prefix + "mlp.act_fn." + name),
                                                         np.float32).reshape(()))
                                   for name in ("alpha_p", "alpha_n", "beta", "eps"))
    return np.array([softplus(alpha_p), beta + softplus(alpha_n), beta, eps], np.float32)


class _Uploader:
    """Host -> device copies through two pinned buffers, overlapping memcpy and DMA."""

    def __init__(self, stream, chunk_bytes: int = 64 << 20):
        self.stream = stream
        self.buffers = [PinnedBuffer(chunk_bytes), PinnedBuffer(chunk_bytes)]
        self.events = [Event(timing=False), Event(timing=False)]
        self.used = [False, False]
        self.turn = 0
        self.bytes = 0

    def copy(self, dst_ptr: int, src: np.ndarray, progress=None) -> None:
        flat = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        chunk = self.buffers[0].nbytes
        for start in range(0, flat.size, chunk):
            part = flat[start: start + chunk]
            i = self.turn
            if self.used[i]:
                self.events[i].synchronize()  # the DMA that read this buffer last time is done
            self.buffers[i].bytes[: part.size] = part
            call(driver.cuMemcpyHtoDAsync, dst_ptr + start, self.buffers[i].ptr, part.size, self.stream.handle)
            self.events[i].record(self.stream)
            self.used[i] = True
            self.turn ^= 1
            self.bytes += part.size
            if progress is not None:
                progress.update(part.size)

    def close(self) -> None:
        self.stream.synchronize()
        for b in self.buffers:
            b.free()
        for e in self.events:
            e.destroy()


class DeviceWeights:
    """A checkpoint's weights on the device. vocab_from: another model's DeviceWeights whose embedding and LM
    head these borrow instead of uploading their own (a DFlash drafter's layers read its target's; the
    checkpoint then needs no embedding, LM head or `model.` prefix: runner/gpu_dflash.py)."""

    def __init__(self, checkpoint, stream, *, progress: bool = True, vocab_from: "DeviceWeights | None" = None):
        cfg = checkpoint.config
        self.config = cfg
        self.arrays: list[DeviceArray] = []
        total = checkpoint.total_bytes
        bar = _progress_bar(total, progress)
        up = _Uploader(stream)
        start = time.perf_counter()
        try:
            def tensor(*names: str) -> DeviceArray:
                parts = [checkpoint.read(n) for n in names]
                rows = sum(p.shape[0] for p in parts)
                out = DeviceArray((rows, *parts[0].shape[1:]), BF16)
                self.arrays.append(out)
                offset = 0
                for p in parts:
                    up.copy(out.ptr + offset, p, bar)
                    offset += p.nbytes
                return out

            def act(p: str) -> DeviceArray | None:
                if cfg.mlp != "xielu":
                    return None
                out = DeviceArray.from_host(xielu_params(checkpoint, p), stream)
                self.arrays.append(out)
                return out

            self.embed = vocab_from.embed if vocab_from else tensor("model.embed_tokens.weight")
            self.layers = []
            attention_norm, mlp_norm = cfg.norm_names
            for i in range(cfg.num_hidden_layers):
                p = f"model.layers.{i}."
                self.layers.append(LayerWeights(
                    input_norm=tensor(p + attention_norm + ".weight"),
                    w_qkv=tensor(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                 p + "self_attn.v_proj.weight"),
                    q_norm=tensor(p + "self_attn.q_norm.weight"),
                    k_norm=tensor(p + "self_attn.k_norm.weight"),
                    w_o=tensor(p + "self_attn.o_proj.weight"),
                    post_norm=tensor(p + mlp_norm + ".weight"),
                    w_up=tensor(*mlp_input_tensors(cfg, p)),
                    w_down=tensor(p + "mlp.down_proj.weight"),
                    act=act(p),
                ))
            self.final_norm = tensor("model.norm.weight")
            if vocab_from:
                self.lm_head = vocab_from.lm_head
            else:
                self.lm_head = self.embed if cfg.tie_word_embeddings else tensor("lm_head.weight")
        finally:
            up.close()
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - start
        self.nbytes = sum(a.nbytes for a in self.arrays)
        self.load_seconds = seconds
        log.info("loaded %.2f GB of weights in %.2f s (%.2f GB/s)", up.bytes / 1e9, seconds,
                 up.bytes / 1e9 / max(seconds, 1e-9))

    def free(self) -> None:
        for a in self.arrays:
            a.free()
        self.arrays.clear()


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", leave=False)
