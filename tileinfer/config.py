"""EngineConfig: every option of an engine, built once from the keyword arguments and validated once.

`LLM(model, **options)` builds one and passes it down: the runner reads its device and sizes, the start-up
its memory settings, the scheduler its limits. Every invalid value raises ValueError naming the option and
what it accepts; nothing touches the GPU before the whole config (and the checkpoint) has been checked.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .kv.paged_cache import check_kv_quantize
from .kv.sizing import DEFAULT_UTILIZATION, check_utilization

DEFAULT_DRAFT_TOKENS = 4  # a draft model's proposals a round unless told otherwise


def check_count(name: str, value) -> None:
    """A count must be an integer >= 1; ValueError naming the option otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def parse_device(device) -> tuple[str, int]:
    """("cuda", ordinal) or ("cpu", 0) from "cuda", "cuda:N", "cpu" or a GPU ordinal."""
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return "cuda", device
    if isinstance(device, str):
        kind, _, ordinal = device.partition(":")
        if kind == "cpu" and not ordinal:
            return "cpu", 0
        if kind == "cuda" and (not ordinal or ordinal.isdigit()):
            return "cuda", int(ordinal or 0)
    raise ValueError(f"device must be 'cuda', 'cuda:N' (a GPU ordinal) or 'cpu' (the float32 numpy runner: "
                     f"slow, exact), got {device!r}")


def parse_address(address: str) -> tuple[str, int]:
    """("host", port) from "HOST:PORT"; ValueError naming the problem."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) < 65536:
        raise ValueError(f"tensor_parallel_address must be HOST:PORT (a port in 1..65535 every rank's host "
                         f"reaches), got {address!r}")
    return host, int(port)


def check_tensor_parallel(size: int, address: str | None, *, cpu: bool, speculative: bool, option=str) -> None:
    """ValueError unless a group of `size` ranks (and `address`, where ranks started by hand connect) can run
    with these options; option(name) is how the caller spells an option (the CLI: --tensor-parallel-size)."""
    if size > 1 and cpu:
        raise ValueError(f"{option('tensor_parallel_size')} > 1 splits a model over GPUs; the CPU runner runs it whole")
    if address is not None:
        parse_address(address)
        if size < 2:
            raise ValueError(f"{option('tensor_parallel_address')} is where the other ranks of a group connect: it "
                             f"needs {option('tensor_parallel_size')} >= 2")
    if size > 1 and speculative:
        raise ValueError(f"speculative decoding ({option('draft_model')}) is not supported with "
                         f"{option('tensor_parallel_size')} > 1")


def _default_draft_tokens(draft_model: Path | None) -> int:
    """A round's proposals when none are asked for: a DFlash drafter's block_size - 1 (all it drafts in one
    forward), else 4. A draft directory that cannot be read gets 4 here; opening it says what is wrong."""
    from .model.config import ConfigError
    from .model.dflash_config import DFlashConfig, is_dflash_dir
    if draft_model is not None and is_dflash_dir(draft_model):
        try:
            return DFlashConfig.from_json(draft_model).max_draft_tokens
        except ConfigError:
            pass
    return DEFAULT_DRAFT_TOKENS


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: Path
    device: str = "cuda"                 # "cuda", "cuda:N", or "cpu" (the float32 reference runner)
    max_num_seqs: int = 256              # requests decoding at once (decode-graph buckets up to this)
    max_context: int = 4096              # positions of the longest request (prompt + output)
    page_size: int = 64
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 4096   # tokens in one step: prompts are prefilled in chunks beside decodes
    gpu_memory_utilization: float = DEFAULT_UTILIZATION  # fraction of the GPU's total memory everything may use
    num_pages: int | None = None         # an explicit KV pool, instead of sizing it from free memory
    max_tokens: int | None = None        # the same, in positions
    kv_quantize: str | None = None       # None / "bf16", or "int8"
    kv_smoothing: bool = True            # INT8 cache: keys divided by the key-norm weight's per-pair factors
    use_graphs: bool = True              # decode and verify steps replay CUDA graphs
    batch_invariant: bool = False        # each request's logits bitwise independent of the batch around it
    async_scheduling: bool = True        # plan and launch step n + 1 before reading step n's tokens
    progress: bool = True                # progress bars while loading
    draft_model: Path | None = None      # a smaller model of the same tokenizer, or a DFlash drafter: speculation
    num_draft_tokens: int | None = None  # proposals a round; None: 4, or a DFlash drafter's block_size - 1
    load_format: str = "auto"            # "auto": the model's weight files; "dummy": weights made from its config
    tensor_parallel_size: int = 1        # GPUs the model is split over (ordinals device .. device + N - 1), over NCCL
    tensor_parallel_address: str | None = None  # "HOST:PORT": rank 0 listens there for ranks started by hand

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "model", Path(self.model))
        if self.draft_model is not None:
            set_(self, "draft_model", Path(self.draft_model))
        kind, ordinal = parse_device(self.device)
        set_(self, "device", "cpu" if kind == "cpu" else f"cuda:{ordinal}")
        if self.num_draft_tokens is None:
            set_(self, "num_draft_tokens", _default_draft_tokens(self.draft_model))
        for name in ("max_num_seqs", "max_context", "page_size", "max_num_batched_tokens", "num_draft_tokens",
                     "tensor_parallel_size"):
            check_count(name, getattr(self, name))
        for name in ("num_pages", "max_tokens"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name))
        if self.num_pages is not None and self.max_tokens is not None:
            raise ValueError("give at most one of num_pages or max_tokens (or neither, to size from free memory)")
        check_utilization(self.gpu_memory_utilization)
        check_tensor_parallel(self.tensor_parallel_size, self.tensor_parallel_address, cpu=kind == "cpu",
                              speculative=self.draft_model is not None)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' (the checkpoint's weight files) or 'dummy' (random "
                             f"weights made from its config.json), got {self.load_format!r}")
        if check_kv_quantize(self.kv_quantize) is False:
            set_(self, "kv_quantize", None)
        for name in ("enable_prefix_caching", "kv_smoothing", "use_graphs", "batch_invariant", "async_scheduling",
                     "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def gpu_ordinal(self) -> int:
        return parse_device(self.device)[1]

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None

    @property
    def tokens_per_verify_row(self) -> int:
        """Tokens one request feeds a verify step: its last committed token and its proposals (1 without a draft)."""
        return 1 + (self.num_draft_tokens if self.speculative else 0)
