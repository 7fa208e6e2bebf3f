"""TileInfer: a single-GPU inference engine for Qwen3 models.

Many requests at once (continuous batching, prefix caching):

    import tileinfer
    with tileinfer.LLM("path/to/Qwen3-checkpoint") as llm:
        for out in llm.generate(["Hello", "The capital of France is"],
                                tileinfer.SamplingParams(max_tokens=32, temperature=0)):
            print(out.text)

One sequence, the same engine loop:

    model = tileinfer.load_model("path/to/Qwen3-checkpoint")      # device="cpu" runs without a GPU
    result = tileinfer.generate(model, "The capital of France is", max_new_tokens=32)
"""
__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

from .chat import ChatSession, ContextFullError
from .config import EngineConfig
from .engine.outputs import RequestOutput, StreamOutput
from .engine.params import SamplingParams
from .engine.speculative import OracleDraft
from .engine.structured import StructuredOutputs
from .generate import GenerationResult, generate, load_model
from .llm import LLM

__all__ = ["ChatSession", "ContextFullError", "EngineConfig", "GenerationResult", "LLM", "OracleDraft",
           "RequestOutput", "SamplingParams", "StreamOutput", "StructuredOutputs", "generate", "load_model"]
