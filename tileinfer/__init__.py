"""TileInfer: a single-GPU inference engine for Qwen3 models.

    import tileinfer
    model = tileinfer.load_model("path/to/Qwen3-checkpoint")
    result = tileinfer.generate(model, "The capital of France is", max_new_tokens=32)
    print(result.text)
"""
from .engine.generate import GenerationResult, generate
from .engine.model import Model, load_model

__all__ = ["GenerationResult", "Model", "generate", "load_model"]
__version__ = "0.1.0"
