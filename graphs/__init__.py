"""CUDA graphs for decode steps: one per batch bucket (imported as tileinfer.graphs)."""
from .decode import DecodeGraphs, bucket_for

__all__ = ["DecodeGraphs", "bucket_for"]
