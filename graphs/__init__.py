"""CUDA graphs: every graph a runner replays, keyed by (kind, bucket) (imported as tileinfer.graphs)."""
from .manager import DECODE, DECODE_MASKED, PREFILL, PREFILL_MASKED, GraphManager, bucket_for

__all__ = ["DECODE", "DECODE_MASKED", "PREFILL", "PREFILL_MASKED", "GraphManager", "bucket_for"]
