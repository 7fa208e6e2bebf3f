"""scripts/train_demo.py's PyTorch Qwen3 against tileinfer's numpy reference, through a written directory.

The script is the demo model's trainer; what it writes must load in tileinfer unchanged and compute
the same logits. Needs torch (a tool of the script, not a dependency of the package): skipped without it.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from tileinfer.model.checkpoint import Checkpoint  # noqa: E402
from tileinfer.model.reference import ReferenceModel  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_demo.py"
SPECIAL = {"<|endoftext|>": 93, "<|im_start|>": 94, "<|im_end|>": 95}


@pytest.fixture(scope="module")
def train_demo():
    spec = importlib.util.spec_from_file_location("train_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = module      # its dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("train_demo", None)


def random_model(train_demo, seed: int):
    """A small Qwen3 with every weight random, norms included, so a wrong q/k norm, RoPE pairing or
    GQA grouping changes the logits well beyond the tolerance."""
    m = train_demo.ModelSpec(hidden=48, layers=2, heads=4, kv_heads=2, intermediate=80, vocab=96, head_dim=16)
    model = train_demo.Qwen3(m)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=generator))
    return m, model.eval()


def test_written_directory_matches_the_reference(train_demo, tmp_path):
    m, model = random_model(train_demo, seed=1)
    out = tmp_path / "model"
    nbytes = train_demo.write_model_dir(model.state_dict(), m, SPECIAL, out, max_shard_bytes=10_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert all(p.stat().st_size <= 10_000 + 4_096 for p in out.glob("model-*.safetensors"))  # + header
    assert nbytes == 2 * train_demo.num_parameters(m)

    ckpt = Checkpoint.open(out)
    assert ckpt.config.num_parameters() == train_demo.num_parameters(m)
    assert ckpt.config.tie_word_embeddings and ckpt.eos_token_ids == [95, 93]
    ids = [3, 17, 95, 40, 41, 2, 88, 60, 5, 5, 71, 12]
    reference = ReferenceModel.from_checkpoint(ckpt).forward(np.asarray(ids))
    with torch.no_grad():
        written = train_demo.load_written(out)(torch.tensor([ids]))[0].numpy()
        in_memory = model(torch.tensor([ids]))[0].numpy()
    assert np.abs(reference).max() > 1.0                       # logits big enough to tell errors apart
    np.testing.assert_allclose(written, reference, atol=1e-4, rtol=0)
    # Only bf16 rounding of the weights separates the trained model from what was written.
    assert 1e-4 < np.abs(in_memory - reference).max() < 0.5


def test_config_is_what_tileinfer_and_transformers_read(train_demo, tmp_path):
    m = train_demo.MODELS["target"][0]
    raw = train_demo.hf_config(m, SPECIAL)
    assert raw["model_type"] == "qwen3" and raw["architectures"] == ["Qwen3ForCausalLM"]
    assert raw["head_dim"] == 128 and raw["num_attention_heads"] > raw["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from tileinfer.model.config import Qwen3Config
    config = Qwen3Config.from_json(tmp_path)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (m.hidden, m.layers, m.vocab)
    assert config.eos_token_id == 95 and config.rope_theta == 1_000_000.0


def test_demo_models_fit_the_size_budget(train_demo):
    total = sum(2 * train_demo.num_parameters(m) for m, _ in train_demo.MODELS.values())
    assert total <= 40_000_000     # target + draft, bf16 bytes


def test_batches_depend_on_seed_model_and_step_only(train_demo, tmp_path):
    np.savez_compressed(tmp_path / "tokens.npz", train_chat=np.arange(5000, dtype=np.uint16) % 96,
                        held_out_chat=np.arange(700, dtype=np.uint16) % 96)
    tokens = train_demo.Tokens(tmp_path, "cpu")
    t = train_demo.SMOKE["target"][1]
    first = tokens.batch(0, 0, 7, t)
    assert first.shape == (t.batch, t.seq + 1)
    assert torch.equal(first, tokens.batch(0, 0, 7, t))
    assert not torch.equal(first, tokens.batch(0, 0, 8, t)) and not torch.equal(first, tokens.batch(0, 1, 7, t))
    windows = tokens.held_out_windows(t.seq, max_windows=100)["chat"]
    assert windows.shape == ((700 - 1) // t.seq, t.seq + 1)
