"""TileInfer: a single-GPU inference engine for Qwen3 models.

Many requests at once (continuous batching, prefix caching):

    import tileinfer
    with tileinfer.LLM("path/to/Qwen3-checkpoint") as llm:
        for out in llm.generate(["Hello", "The capital of France is"],
                                tileinfer.SamplingParams(max_tokens=32, temperature=0)):
            print(out.text)

One sequence, the smallest path through the engine:

    model = tileinfer.load_model("path/to/Qwen3-checkpoint")
    result = tileinfer.generate(model, "The capital of France is", max_new_tokens=32)
"""
__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

from .engine.chat import ChatSession, ContextFullError
from .engine.generate import GenerationResult, generate
from .engine.llm import LLM, RequestOutput, StreamOutput
from .engine.model import Model, load_model
from .engine.params import SamplingParams
from .engine.speculative import OracleDraft

__all__ = ["ChatSession", "ContextFullError", "GenerationResult", "LLM", "Model", "OracleDraft", "RequestOutput", "SamplingParams",
           "StreamOutput", "generate", "load_model"]
