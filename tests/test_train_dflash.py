"""scripts/train_dflash.py's PyTorch DFlash drafter against tileinfer's numpy one, through a written directory.

The script trains the demo target's drafter; what it writes must load in tileinfer unchanged and compute
the same logits, and its training blocks (anchors, masks, labels) must be what a DFlash round sees. Tiny
random models (every weight random, norms included) make a wrong q/k norm, RoPE pairing, GQA grouping,
mask or fc/hidden_norm order change the logits far beyond the tolerance. Needs torch (a tool of the script,
not a dependency of the package): skipped without it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from tileinfer.model.checkpoint import Checkpoint  # noqa: E402
from tileinfer.model.config import read_config  # noqa: E402
from tileinfer.model.dflash_config import DFlashConfig  # noqa: E402
from tileinfer.model.dflash_reference import DFlashReference  # noqa: E402
from tileinfer.model.reference import ReferenceModel  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_dflash.py"
DEMO_TARGET = REPO / "tileinfer" / "demo" / "target"
SPECIAL = {"<|endoftext|>": 93, "<|im_start|>": 94, "<|im_end|>": 95}
MASK = 92                       # never in the tiny models' text below
LAYER_IDS = (0, 2)              # of a 3-layer target: the last one is read as its final-normed state
BLOCK = 6


@pytest.fixture(scope="module")
def train_dflash():
    spec = importlib.util.spec_from_file_location("train_dflash", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_dflash"] = module    # its dataclasses look their module up while being built
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                # tiny ops: intra-op threads only wait on each other on a shared CPU
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("train_dflash", None)
        torch.set_num_threads(threads)


def randomize(model, seed: int, scale: float = 0.15) -> None:
    """Every weight random: norms around 1 (0.5 spread), the rest N(0, scale)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=generator))


@pytest.fixture(scope="module")
def models(train_dflash, tmp_path_factory):
    """A tiny random target and drafter (3 target layers; 2 drafter layers of 4 query and 2 KV heads), written
    and loaded back: the torch target, the torch drafter in memory and as read back from its bf16 weights,
    tileinfer's ReferenceModel and bound DFlashReference, the drafter's directory."""
    demo = train_dflash.train_demo
    root = tmp_path_factory.mktemp("dflash-train")
    m = demo.ModelSpec(hidden=48, layers=3, heads=4, kv_heads=2, intermediate=80, vocab=96, head_dim=16)
    target = demo.Qwen3(m)
    randomize(target, seed=1)
    demo.write_model_dir(target.state_dict(), m, SPECIAL, root / "target")
    target_config = read_config(root / "target")
    config = DFlashConfig(decoder=dataclasses.replace(target_config, num_hidden_layers=2, intermediate_size=40),
                          block_size=BLOCK, mask_token_id=MASK, target_layer_ids=LAYER_IDS, num_target_layers=3)
    drafter = train_dflash.DFlashDrafter(config)
    randomize(drafter, seed=2)
    train_dflash.write_drafter(drafter.state_dict(), config, root / "draft", notice_text="test notice\n")
    reference_target = ReferenceModel.from_checkpoint(Checkpoint.open(root / "target"))
    reference = DFlashReference.from_checkpoint(Checkpoint.open_draft(root / "draft"))
    reference.bind_target(reference_target)
    return SimpleNamespace(target=train_dflash.load_target(root / "target", "cpu"), in_memory=drafter.eval(),
                           drafter=train_dflash.load_drafter(root / "draft"), reference_target=reference_target,
                           reference=reference, directory=root / "draft")


def text(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MASK, length)


def torch_block_logits(drafter, target, features, context, block, start) -> np.ndarray:
    """The torch drafter's logits of block rows 1.. for one block at `start` over features at `context`."""
    embed = target.model.embed_tokens.weight
    with torch.no_grad():
        h = drafter(torch.from_numpy(features)[None], torch.from_numpy(np.asarray(context, np.int64))[None],
                    torch.nn.functional.embedding(torch.tensor([block]), embed),
                    torch.arange(start, start + len(block))[None])
        return torch.nn.functional.linear(h[0, 1:], embed).numpy()


def test_written_directory_is_a_drafter_tileinfer_reads(train_dflash, models, tmp_path):
    directory = models.directory
    assert sorted(p.name for p in directory.iterdir()) == ["NOTICE", "config.json", "model.safetensors"]
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == BLOCK
    assert raw["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": list(LAYER_IDS)}
    assert raw["num_target_layers"] == 3 and raw["layer_types"] == ["full_attention"] * 2
    assert Checkpoint.open_draft(directory).config == models.drafter.config
    with pytest.raises(ValueError, match="differ from a DFlash drafter's"):
        train_dflash.write_drafter({"fc.weight": torch.zeros(2, 2)}, models.drafter.config, tmp_path / "bad")


@pytest.mark.parametrize("context, start", [
    (list(range(11)), 11),              # every earlier position
    ([0, 2, 3, 7, 8], 11),              # a context of non-contiguous positions (RoPE at the target's positions)
    ([], 4),                            # no context: the block alone
    ([5, 9, 12, 13], 14),
])
def test_forward_equals_the_reference(models, context, start):
    reference = models.reference
    ids = text(20, seed=3)
    _, features = models.reference_target.forward_features(ids, LAYER_IDS)
    block = reference.block(int(ids[start]), BLOCK - 1)
    cache = reference.new_cache()
    entry = cache.append_positions(np.concatenate([np.asarray(context, np.int64), start + np.arange(BLOCK)]))
    expected = reference.forward(features[context], np.asarray(context, np.int64), block, start, cache, entry)
    written = torch_block_logits(models.drafter, models.target, features[context], context, block, start)
    in_memory = torch_block_logits(models.in_memory, models.target, features[context], context, block, start)
    scale = np.abs(expected).max()
    assert scale > 1.0                                      # logits big enough to tell errors apart
    np.testing.assert_allclose(written, expected, atol=1e-4 * scale, rtol=0)
    # Only bf16 rounding of the weights separates the trained drafter from what was written.
    assert 1e-4 * scale < np.abs(in_memory - expected).max() < 0.2 * scale


def test_target_features_and_labels_equal_the_reference(train_dflash, models):
    target, reference_target = models.target, models.reference_target
    ids = text(18, seed=5)
    logits, expected = reference_target.forward_features(ids, LAYER_IDS)
    features, greedy = train_dflash.target_pass(target, torch.from_numpy(ids)[None], LAYER_IDS, autocast=False)
    np.testing.assert_allclose(features[0].numpy(), expected, atol=1e-4 * np.abs(expected).max(), rtol=0)
    assert greedy[0].tolist() == logits.argmax(axis=1).tolist()


def test_training_blocks_equal_separate_reference_rounds(train_dflash, models):
    """All anchors of two windows in one masked drafter call give each block the logits tileinfer gives it
    alone over the context before its anchor; row j's label is the target's argmax at a + j - 1, i.e. its
    choice for the token at a + j that row j drafts."""
    target, drafter, reference_target, reference = (models.target, models.drafter, models.reference_target,
                                                    models.reference)
    windows = np.stack([text(16, seed=6), text(16, seed=7)])
    anchors = torch.tensor([[1, 5, 10], [2, 3, 11]])
    features, greedy = train_dflash.target_pass(target, torch.from_numpy(windows), LAYER_IDS, autocast=False)
    blocks = train_dflash.make_blocks(torch.from_numpy(windows), greedy, anchors, BLOCK, MASK)
    with torch.no_grad():
        logits = train_dflash.block_logits(drafter, target.model.embed_tokens.weight, features, blocks,
                                           autocast=False).numpy()
    assert logits.shape == (2, 3, BLOCK - 1, 96)
    for w in range(2):
        target_logits, window_features = reference_target.forward_features(windows[w], LAYER_IDS)
        for i, a in enumerate(anchors[w].tolist()):
            context = np.arange(a)
            cache = reference.new_cache()
            entry = cache.append_positions(np.arange(a + BLOCK))
            expected = reference.forward(window_features[:a], context, reference.block(int(windows[w, a]), BLOCK - 1),
                                         a, cache, entry)
            np.testing.assert_allclose(logits[w, i], expected, atol=1e-4 * np.abs(expected).max(), rtol=0)
            assert blocks.labels[w, i].tolist() == target_logits[a:a + BLOCK - 1].argmax(axis=1).tolist()


def test_make_blocks_by_hand(train_dflash):
    tokens = torch.arange(10, 18)[None]                    # the token at position p is 10 + p
    greedy = torch.arange(20, 28)[None]                    # the target's argmax at p (its choice for p + 1): 20 + p
    blocks = train_dflash.make_blocks(tokens, greedy, torch.tensor([[1, 4]]), block_size=3, mask_token_id=99)
    assert blocks.ids.tolist() == [[11, 99, 99, 14, 99, 99]]
    assert blocks.positions.tolist() == [[1, 2, 3, 4, 5, 6]]
    # Row j of the block at a drafts position a + j; the target's choice there is its argmax at a + j - 1.
    assert blocks.labels.tolist() == [[[21, 22], [24, 25]]]
    anchor_1 = [1, 0, 0, 0, 0, 0, 0, 0] + [1, 1, 1, 0, 0, 0]     # context < 1, its own block
    anchor_4 = [1, 1, 1, 1, 0, 0, 0, 0] + [0, 0, 0, 1, 1, 1]     # context < 4, its own block
    assert blocks.visible.int().tolist() == [[anchor_1] * 3 + [anchor_4] * 3]


def test_anchors_loss_weights_and_acceptance(train_dflash):
    rng = np.random.default_rng(0)
    anchors = train_dflash.sample_anchors(rng, windows=3, seq=40, count=20, block_size=16)
    assert anchors.shape == (3, 20) and anchors.min() >= 1 and anchors.max() <= 40 - 16 + 1
    assert all(len(set(row)) == 20 and list(row) == sorted(row) for row in anchors)
    assert (train_dflash.sample_anchors(np.random.default_rng(0), 3, 40, 20, 16) == anchors).all()
    with pytest.raises(ValueError, match="do not fit"):
        train_dflash.sample_anchors(rng, 1, 20, 6, 16)

    weights = train_dflash.loss_weights(16, 7.0)
    assert weights.shape == (15,) and weights[0] == 1 and math.isclose(weights[1], math.exp(-1 / 7), rel_tol=1e-6)
    assert (weights[1:] < weights[:-1]).all()

    labels = torch.tensor([[3, 1, 2], [3, 1, 2], [3, 1, 2]])
    logits = torch.nn.functional.one_hot(torch.tensor([[3, 1, 0], [0, 1, 2], [3, 1, 2]]), 5).float()
    assert train_dflash.acceptance(logits, labels).tolist() == [3, 1, 4]


def test_round_lengths_walk_from_round_to_round(train_dflash):
    # Acceptance of a round anchored at each position; rounds start at 0 and jump by what they accept.
    assert train_dflash.round_lengths([2, 9, 1, 3, 1, 1, 2]) == [2, 1, 3, 2]
    assert train_dflash.round_lengths([]) == []


def test_evaluation_rounds_equal_dflash_greedy(train_dflash, models):
    numpy_lengths, torch_lengths, same = train_dflash.compare_rounds(
        models.reference_target, models.reference, models.target, models.drafter, text(7, seed=8), n=24)
    # The prefill gives the first of the 24 tokens, the rounds the other 23.
    assert same and sum(numpy_lengths) == 23 and sum(torch_lengths) >= 23 - BLOCK


def test_a_few_steps_on_one_batch_lower_the_loss(train_dflash, models):
    """Gradients reach the drafter (not the frozen target) and the weighted loss goes down."""
    target = models.target
    drafter = train_dflash.DFlashDrafter(models.drafter.config)
    windows = torch.from_numpy(np.stack([text(24, seed=9), text(24, seed=10)]))
    anchors = torch.from_numpy(train_dflash.sample_anchors(np.random.default_rng(1), 2, 24, 4, BLOCK))
    weights = train_dflash.loss_weights(BLOCK, 7.0)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss, _, _ = train_dflash.batch_loss(drafter, target, windows, anchors, weights, autocast=False)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.grad is None for p in target.parameters())


def test_demo_drafter_shape(train_dflash):
    target = read_config(DEMO_TARGET)
    shape, _ = train_dflash.DEMO
    config = train_dflash.drafter_config(target, shape, train_dflash.mask_token_id(DEMO_TARGET))
    config.check_target(target)
    assert config.target_layer_ids == (1, 3, 5) and config.num_target_layers == 8 and config.block_size == 16
    assert (config.hidden_size, config.decoder.head_dim, config.num_hidden_layers) == (384, 128, 2)
    assert 2 * train_dflash.num_parameters(config) <= 6_000_000          # bf16 bytes: it ships as package data
    assert DFlashConfig.from_dict(config.to_hf_dict()) == config
    # The mask token is an added token the chat template never writes.
    assert config.mask_token_id == 8185
    template = json.loads((DEMO_TARGET / "tokenizer_config.json").read_text())["chat_template"]
    assert train_dflash.MASK_TOKEN not in template
    # z-lab's spacing: Qwen3-8B-DFlash-b16 reads [1, 9, 17, 25, 33] of 36 layers with 5.
    assert train_dflash.spread_layer_ids(36, 5) == (1, 9, 17, 25, 33)
