"""The memory-sizing utility: `tileinfer size MODEL` and `scripts/kv_sizing.py MODEL` (the same code).

MODEL is a preset name (qwen3-4b, apertus-8b), a checkpoint directory or a config.json. Prints the KV cache's
bytes per position and per page in BF16 and INT8, the cache at each --context, the weights, and
how many positions and sequences of each context fit on the GPU (NVML) or in --gpu-memory GB.

Units follow the seed's table: per position and per page in KiB (2^10 bytes) rounded to the
nearest integer ("57.75 KiB" prints as "58 KiB"); sizes in GB (10^9 bytes) to two significant
digits ("0.60 GB", "3.8 GB", "16 GB"; from 100 GB on, whole GB). --json gives exact bytes.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tileinfer.kv import sizing
from tileinfer.model.checkpoint import Checkpoint, CheckpointError
from tileinfer.model.config import PRESETS, ModelConfig, read_config

DEFAULT_CONTEXTS = "4096,32768"
DESCRIPTION = " ".join(__doc__.split("\n\n")[1].split())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The utility's arguments (shared by `tileinfer size` and scripts/kv_sizing.py)."""
    parser.add_argument("model", metavar="MODEL",
                        help=f"a preset ({', '.join(PRESETS)}), a checkpoint directory or a config.json")
    parser.add_argument("--context", default=DEFAULT_CONTEXTS, metavar="N[,N...]",
                        help=f"context lengths (positions) to size the cache for (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--page-size", type=int, default=sizing.DEFAULT_PAGE_SIZE,
                        help=f"positions per page (default {sizing.DEFAULT_PAGE_SIZE})")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                        help="size against this much GPU memory (GB, 10^9 bytes, nothing else on it) instead of "
                             "reading the GPU through NVML; needed to see what fits when there is no GPU")
    parser.add_argument("--device", type=int, default=0, help="GPU index to read through NVML (default 0)")
    parser.add_argument("--utilization", type=float, default=sizing.DEFAULT_UTILIZATION,
                        help="fraction of the GPU's TOTAL memory that everything on it together may use: memory "
                             "already in use (other processes) is subtracted, (1 - u) x total stays free "
                             f"(default {sizing.DEFAULT_UTILIZATION})")
    parser.add_argument("--reserve-gb", type=float, default=sizing.DEFAULT_RESERVE_BYTES / 1e9, metavar="GB",
                        help="memory kept for everything but weights and cache: the CUDA context, compiled kernels, "
                             "the activation workspace and logits of a prefill chunk, step buffers, decode graphs "
                             f"(default {sizing.DEFAULT_RESERVE_BYTES / 1e9:g})")
    parser.add_argument("--json", action="store_true", help="print exact byte counts as JSON instead of a table")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "kv_sizing.py") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        return run(args)
    except ValueError as e:   # ConfigError, CheckpointError and bad arguments are ValueErrors
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    """Print the report for parsed arguments; raises ValueError naming the bad input."""
    report = build_report(args)
    print(json.dumps(report, indent=2) if args.json else render_table(report))
    return 0


# ---------------------------------------------------------------------------- inputs

def resolve_model(spec: str) -> tuple[str, ModelConfig]:
    """(kind, config) for a preset name, a checkpoint directory or a config.json, tried in that order."""
    if spec.lower() in PRESETS:
        return "preset", PRESETS[spec.lower()]
    path = Path(spec)
    if path.is_dir():
        try:
            return "checkpoint", Checkpoint.open(path).config
        except CheckpointError as e:
            if not (path / "config.json").is_file():
                raise
            raise CheckpointError(f"{e} (to size from the config alone, give its config.json)") from None
    if path.is_file():
        return "config.json", read_config(path)
    choices = f"choose one of {', '.join(PRESETS)} or give a checkpoint directory / config.json"
    if path.suffix == ".json" or len(path.parts) > 1:
        raise ValueError(f"{spec}: no such file or directory; {choices}")
    raise ValueError(f"unknown preset {spec!r}; {choices}")


def parse_contexts(text: str) -> list[int]:
    contexts = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            raise ValueError(f"--context: {item.strip()!r} is not a whole number of positions") from None
        if value <= 0:
            raise ValueError(f"--context: context lengths must be positive, got {value}")
        if value not in contexts:
            contexts.append(value)
    return contexts


def _gb_to_bytes(name: str, gb: float, allow_zero: bool) -> int:
    if not math.isfinite(gb) or gb < 0 or (gb == 0 and not allow_zero):
        what = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {what} number of GB, got {gb:g}")
    return round(gb * 1e9)


# ---------------------------------------------------------------------------- the numbers

def build_report(args: argparse.Namespace) -> dict:
    """Every number the table shows, in exact bytes (this is also the --json output)."""
    contexts = parse_contexts(args.context)
    if args.page_size <= 0:
        raise ValueError(f"--page-size must be a positive number of positions, got {args.page_size}")
    if not 0 < args.utilization <= 1:
        raise ValueError(f"--utilization must be in (0, 1], a fraction of the GPU's total memory; "
                         f"got {args.utilization:g}")
    reserve = _gb_to_bytes("--reserve-gb", args.reserve_gb, allow_zero=True)
    kind, config = resolve_model(args.model)
    report = {
        "model": args.model, "source": kind,
        "layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "page_size": args.page_size, "contexts": contexts,
        "num_parameters": config.num_parameters(), "tied_embeddings": config.tie_word_embeddings,
        "weight_bytes": sizing.weight_bytes(config),
        "kv": {dtype: {"bytes_per_position": sizing.bytes_per_position(config, dtype),
                       "bytes_per_page": sizing.bytes_per_page(config, args.page_size, dtype),
                       "cache_bytes": {str(c): sizing.cache_bytes(config, c, args.page_size, dtype)
                                       for c in contexts}}
               for dtype in sizing.KV_DTYPES},
        "fit": None, "fit_note": None,
    }
    memory = _device_memory(args)
    if isinstance(memory, str):
        report["fit_note"] = memory
        return report
    source, total, used = memory
    plans = {dtype: sizing.plan(config, total, used_bytes=used, utilization=args.utilization,
                                reserve_bytes=reserve, page_size=args.page_size, kv_dtype=dtype, contexts=contexts)
             for dtype in sizing.KV_DTYPES}
    any_plan = plans["bf16"]
    report["fit"] = {
        "memory_source": source, "total_bytes": total, "used_bytes": used, "utilization": args.utilization,
        "usable_bytes": any_plan.usable_bytes, "reserve_bytes": reserve,
        "cache_budget_bytes": any_plan.cache_budget_bytes,
        **{dtype: {"pages": p.pages, "positions": p.positions,
                   "sequences": {str(c): n for c, n in p.sequences.items()}}
           for dtype, p in plans.items()},
    }
    if any_plan.cache_budget_bytes < 0:
        report["fit_note"] = "the weights and the reserve alone exceed the usable memory; no cache fits"
    return report


def _device_memory(args) -> tuple[str, int, int] | str:
    """(source, total, used) from --gpu-memory or NVML, or a note saying why nothing can be fitted."""
    if args.gpu_memory is not None:
        return "--gpu-memory", _gb_to_bytes("--gpu-memory", args.gpu_memory, allow_zero=False), 0
    try:
        _free, total, used = sizing.nvml_memory(args.device)
    except RuntimeError as e:
        return f"how many positions and sequences fit: give --gpu-memory GB, or run where NVML sees a GPU; {e}"
    return f"GPU {args.device} (NVML)", total, used


# ---------------------------------------------------------------------------- the table

def format_kib(nbytes: int) -> str:
    """Bytes in KiB rounded to the nearest integer, halves up (the seed: 59,136 B -> '58 KiB')."""
    return f"{(nbytes + 512) // 1024:,} KiB"


def format_gb(nbytes: int) -> str:
    """Bytes in GB (10^9) to two significant digits, trailing zero kept ('0.60 GB'); whole GB from 100 on."""
    gb = nbytes / 1e9
    if nbytes == 0:
        return "0 GB"
    if gb >= 99.5:
        return f"{round(gb):,} GB"
    return f"{gb:#.2g}".rstrip(".") + " GB"


def _count(n: int) -> str:
    return f"{n:,}"


def render_table(report: dict) -> str:
    contexts, fit = report["contexts"], report["fit"]
    header = ["KV cache", "per position", "per page"] + [f"{_count(c)} positions" for c in contexts]
    if fit:
        header += ["positions that fit"] + [f"seqs of {_count(c)}" for c in contexts]
    rows = []
    for dtype, kv in report["kv"].items():
        row = [dtype.upper(), format_kib(kv["bytes_per_position"]), format_kib(kv["bytes_per_page"])]
        row += [format_gb(kv["cache_bytes"][str(c)]) for c in contexts]
        if fit:
            row += [_count(fit[dtype]["positions"])] + [_count(fit[dtype]["sequences"][str(c)]) for c in contexts]
        rows.append(row)

    params = report["num_parameters"]
    params_text = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:,.0f} M"
    lines = [f"{report['model']} ({report['source']}): {report['layers']} layers, {report['kv_heads']} KV heads "
             f"of {report['head_dim']}, page size {report['page_size']}",
             f"weights: {format_gb(report['weight_bytes'])} ({params_text} parameters in bf16"
             f"{', the tied embedding counted once' if report['tied_embeddings'] else ''})"]
    if fit:
        in_use = f"- {format_gb(fit['used_bytes'])} in use " if fit["memory_source"] != "--gpu-memory" else ""
        lines.append(f"fit: {fit['utilization']:g} x {format_gb(fit['total_bytes'])} ({fit['memory_source']}) "
                     f"{in_use}- {format_gb(report['weight_bytes'])} weights "
                     f"- {format_gb(fit['reserve_bytes'])} reserve = {format_gb(max(0, fit['cache_budget_bytes']))} "
                     f"for the cache")
    lines += ["", *_aligned([header, *rows])]
    if report["fit_note"]:
        lines += ["", report["fit_note"]]
    return "\n".join(lines)


def _aligned(rows: list[list[str]]) -> list[str]:
    """Columns two spaces apart: the first left-aligned, the numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in rows]
