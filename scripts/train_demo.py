"""Train the demo models, a small Qwen3 and its draft, with PyTorch; write both as Hugging Face directories.

    python scripts/train_demo.py --data build/demo-data --out build/demo-model [--minutes 8] [--resume]
    python scripts/train_demo.py --smoke --check          # a tiny run on the CPU, then the logits check

PyTorch is this script's tool, never the package's. The model is Qwen3's architecture written out
in plain PyTorch: RMSNorm before attention and MLP, per-head RMSNorm of q and k (over head_dim)
before rotate-half RoPE, grouped-query attention with head_dim 128 through
scaled_dot_product_attention, a SwiGLU MLP, tied embeddings. Training: random windows of the packed
token stream from scripts/prepare_demo_data.py, bf16 autocast on the GPU, AdamW, linear warm-up
then cosine decay, gradient clipping. The schedule is fixed in steps (epochs of the training
tokens), so a run cut by --minutes and continued with --resume follows the same schedule; batch i
is drawn from a generator seeded by (seed, model, i). Held-out loss is measured every --eval-every
steps and the weights with the lowest one are written.

Writes OUT/target and OUT/draft (config.json, generation_config.json, tokenizer.json,
tokenizer_config.json, NOTICE, bf16 safetensors in shards of at most 15 MiB with
model.safetensors.index.json when there is more than one), OUT/train-log.jsonl, and the resume
state in OUT/state/ (kept only as long as the machine is).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

MAX_SHARD_BYTES = 15 * 2**20
MAX_POSITIONS = 4096            # config.json's max_position_embeddings (the CLI's default --max-context)
ROPE_THETA = 1_000_000.0        # Qwen3's
RMS_EPS = 1e-6
WRITE_MARGIN_S = 30             # time kept back from --minutes for writing the directories


@dataclass(slots=True, frozen=True)
class ModelSpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 8192
    head_dim: int = 128


@dataclass(slots=True, frozen=True)
class TrainSpec:
    epochs: float               # passes over the training tokens: fixes the number of steps
    lr: float
    batch: int                  # windows per step
    seq: int                    # tokens per window
    dropout: float
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    eval_every: int = 200
    log_every: int = 50


# 16.1M + 3.3M parameters: 38.8 MB of bf16 weights together.
MODELS = {
    "target": (ModelSpec(hidden=384, layers=8, heads=4, kv_heads=2, intermediate=896),
               TrainSpec(epochs=10, lr=2e-3, batch=64, seq=512, dropout=0.1)),
    "draft": (ModelSpec(hidden=256, layers=2, heads=2, kv_heads=1, intermediate=512),
              TrainSpec(epochs=10, lr=3e-3, batch=64, seq=512, dropout=0.0)),
}
SMOKE = {
    "target": (ModelSpec(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128),
               TrainSpec(epochs=0.005, lr=3e-3, batch=8, seq=128, dropout=0.0, warmup=5, eval_every=10,
                         log_every=5)),
    "draft": (ModelSpec(hidden=32, layers=1, heads=1, kv_heads=1, intermediate=64),
              TrainSpec(epochs=0.004, lr=3e-3, batch=8, seq=128, dropout=0.0, warmup=5, eval_every=10,
                        log_every=5)),
}


# ---------------------------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the input, then back, as transformers' Qwen3RMSNorm does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_tables(seq: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for positions 0..seq-1; channel i pairs with i + head_dim/2. # [seq, head_dim] each"""
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angle = torch.arange(seq, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos().float(), angle.sin().float()


class Attention(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.m = m
        self.q_proj = nn.Linear(m.hidden, m.heads * m.head_dim, bias=False)
        self.k_proj = nn.Linear(m.hidden, m.kv_heads * m.head_dim, bias=False)
        self.v_proj = nn.Linear(m.hidden, m.kv_heads * m.head_dim, bias=False)
        self.o_proj = nn.Linear(m.heads * m.head_dim, m.hidden, bias=False)
        self.q_norm = RMSNorm(m.head_dim)
        self.k_norm = RMSNorm(m.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        m = self.m
        # Qwen3 normalises each head's q and k over head_dim, then rotates. # [b, heads, t, head_dim]
        q = self.q_norm(self.q_proj(x).view(b, t, m.heads, m.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, m.kv_heads, m.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, m.kv_heads, m.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = m.heads // m.kv_heads        # query head h reads KV head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # Under autocast the norms hand back float32 (their weights are float32), v is bf16.
        out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, m.heads * m.head_dim))


class MLP(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(m.hidden, m.intermediate, bias=False)
        self.up_proj = nn.Linear(m.hidden, m.intermediate, bias=False)
        self.down_proj = nn.Linear(m.intermediate, m.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, m: ModelSpec, dropout: float):
        super().__init__()
        self.input_layernorm = RMSNorm(m.hidden)
        self.self_attn = Attention(m)
        self.post_attention_layernorm = RMSNorm(m.hidden)
        self.mlp = MLP(m)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.dropout(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.dropout(self.mlp(self.post_attention_layernorm(h)))


class Decoder(nn.Module):
    """`model.*` of Qwen3ForCausalLM: parameter names are Hugging Face's once prefixed with 'model.'."""

    def __init__(self, m: ModelSpec, dropout: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleList(Layer(m, dropout) for _ in range(m.layers))
        self.norm = RMSNorm(m.hidden)


class Qwen3(nn.Module):
    def __init__(self, m: ModelSpec, dropout: float = 0.0):
        super().__init__()
        self.spec = m
        self.model = Decoder(m, dropout)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 0.02 / math.sqrt(2 * self.spec.layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits, the LM head tied to the embedding. ids: [b, t] -> [b, t, vocab]"""
        cos, sin = rope_tables(ids.shape[1], self.spec.head_dim, ids.device)
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return F.linear(self.model.norm(h), self.model.embed_tokens.weight)


def num_parameters(m: ModelSpec) -> int:
    attn = m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads) + 2 * m.head_dim
    per_layer = attn + 3 * m.hidden * m.intermediate + 2 * m.hidden
    return m.vocab * m.hidden + m.layers * per_layer + m.hidden


def flops_per_token(m: ModelSpec, seq: int) -> float:
    """Training FLOPs per token: 6 x the matmul parameters (the tied head included) + causal attention."""
    matmul = num_parameters(m) - m.layers * (2 * m.hidden + 2 * m.head_dim) - m.hidden
    attention = 6 * m.layers * m.heads * m.head_dim * seq      # QK^T and PV over seq/2 keys on average, x3
    return 6 * matmul + attention


# ---------------------------------------------------------------------------------------------- data


class Tokens:
    """The prepared token arrays: one training stream, held-out streams per source."""

    def __init__(self, data: Path, device):
        arrays = np.load(data / "tokens.npz")
        names = sorted(k[len("train_"):] for k in arrays.files if k.startswith("train_"))
        self.train = torch.from_numpy(np.concatenate([arrays[f"train_{n}"] for n in names]).astype(np.int64)).to(device)
        self.held_out = {n: torch.from_numpy(arrays[f"held_out_{n}"].astype(np.int64)).to(device) for n in names}

    def batch(self, seed: int, model_index: int, step: int, t: TrainSpec) -> torch.Tensor:
        """Batch `step`: t.batch random windows of t.seq + 1 tokens. # [batch, seq + 1]"""
        rng = np.random.default_rng([seed, model_index, step])
        starts = torch.from_numpy(rng.integers(0, len(self.train) - t.seq - 1, t.batch)).to(self.train.device)
        return self.train[starts[:, None] + torch.arange(t.seq + 1, device=self.train.device)]

    def held_out_windows(self, seq: int, max_windows: int) -> dict[str, torch.Tensor]:
        """Consecutive windows of each held-out stream. # name -> [windows, seq + 1]"""
        out = {}
        for name, stream in self.held_out.items():
            n = min(max_windows, (len(stream) - 1) // seq)
            out[name] = torch.stack([stream[i * seq:i * seq + seq + 1] for i in range(n)])
        return out


def loss_of(model: nn.Module, windows: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(windows[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: nn.Module, held_out: dict[str, torch.Tensor], batch: int, autocast: bool) -> dict[str, float]:
    model.eval()
    losses = {}
    for name, windows in held_out.items():
        total = sum(loss_of(model, windows[i:i + batch], autocast).item() * len(windows[i:i + batch])
                    for i in range(0, len(windows), batch))
        losses[name] = total / len(windows)
    model.train()
    losses["mean"] = sum(losses.values()) / len(losses)
    return losses


# ---------------------------------------------------------------------------------------------- training


def learning_rate(step: int, total: int, t: TrainSpec) -> float:
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    progress = (step - t.warmup) / max(1, total - t.warmup)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, t: TrainSpec, fused: bool) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]      # matrices and the embedding
    rest = [p for n, p in model.named_parameters() if p.ndim != 2]       # norm weights
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


@dataclass
class Run:
    """One model's training, everything a resume needs."""
    name: str
    model: Qwen3
    optimizer: torch.optim.AdamW
    total_steps: int
    step: int = 0
    best_loss: float = math.inf
    best_step: int = -1
    best_state: dict | None = None

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                "total_steps": self.total_steps, "best_loss": self.best_loss, "best_step": self.best_step,
                "best_state": self.best_state}

    def load(self, state: dict) -> None:
        if state["total_steps"] != self.total_steps:
            raise SystemExit(f"{self.name}: the saved state plans {state['total_steps']} steps, this run "
                             f"{self.total_steps}; resume with the same settings or start without --resume")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.best_loss, self.best_step = state["step"], state["best_loss"], state["best_step"]
        self.best_state = state["best_state"]


def train(run: Run, t: TrainSpec, tokens: Tokens, args, model_index: int, deadline: float, log) -> bool:
    """Steps until the schedule ends (True) or the deadline passes (False)."""
    autocast = tokens.train.is_cuda
    held_out = tokens.held_out_windows(t.seq, args.eval_windows)
    flops = flops_per_token(run.model.spec, t.seq)
    run.model.train()
    timer, timed_tokens = time.perf_counter(), 0
    while run.step < run.total_steps:
        if time.time() > deadline:
            return False
        lr = learning_rate(run.step, run.total_steps, t)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        loss = loss_of(run.model, tokens.batch(args.seed, model_index, run.step, t), autocast)
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
        run.optimizer.step()
        run.step += 1
        timed_tokens += t.batch * t.seq
        last = run.step == run.total_steps
        if run.step % t.log_every == 0 or last:
            seconds = time.perf_counter() - timer
            rate = timed_tokens / seconds
            log(run.name, step=run.step, of=run.total_steps, loss=round(loss.item(), 4), lr=float(f"{lr:.3g}"),
                grad_norm=round(norm.item(), 3), tokens_per_s=round(rate), tflops=round(rate * flops / 1e12, 1))
            timer, timed_tokens = time.perf_counter(), 0
        if run.step % t.eval_every == 0 or last:
            losses = evaluate(run.model, held_out, t.batch, autocast)
            if losses["mean"] < run.best_loss:
                run.best_loss, run.best_step = losses["mean"], run.step
                run.best_state = {k: v.detach().to("cpu", copy=True) for k, v in run.model.state_dict().items()}
            log(run.name, step=run.step, held_out={k: round(v, 4) for k, v in losses.items()},
                held_out_ppl={k: round(math.exp(v), 2) for k, v in losses.items()}, best_step=run.best_step)
    return True


# ---------------------------------------------------------------------------------------------- writing


def hf_config(m: ModelSpec, special: dict[str, int]) -> dict:
    """config.json as transformers' Qwen3Config writes it."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": special["<|endoftext|>"], "eos_token_id": special["<|im_end|>"],
        "head_dim": m.head_dim, "hidden_act": "silu", "hidden_size": m.hidden, "initializer_range": 0.02,
        "intermediate_size": m.intermediate, "max_position_embeddings": MAX_POSITIONS, "max_window_layers": m.layers,
        "num_attention_heads": m.heads, "num_hidden_layers": m.layers, "num_key_value_heads": m.kv_heads,
        "rms_norm_eps": RMS_EPS, "rope_scaling": None, "rope_theta": ROPE_THETA, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": m.vocab,
    }


def generation_config(special: dict[str, int]) -> dict:
    return {"bos_token_id": special["<|endoftext|>"], "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
            "pad_token_id": special["<|endoftext|>"], "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}


def shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, grouped into shards of at most max_bytes."""
    shards, size = [{}], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_bytes:
            raise ValueError(f"{name} alone ({nbytes} bytes) is over the shard limit of {max_bytes}")
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_weights(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """bf16 safetensors, one file or shards with an index; returns the bytes of weights."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().to("cpu", torch.bfloat16).contiguous() for name, tensor in state.items()}
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    shards = shard(tensors, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    for file, part in zip(files, shards):
        save_file(part, str(out / file), metadata={"format": "pt"})
        (out / file).chmod(0o644)       # safetensors writes 0600
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        weight_map = {name: file for file, part in zip(files, shards) for name in part}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_model_dir(state: dict[str, torch.Tensor], m: ModelSpec, special: dict[str, int], out: Path,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """Weights, config.json and generation_config.json of a Qwen3ForCausalLM directory; `state` is
    a Qwen3 module's state dict (its names are HF's). Returns the bytes of weights."""
    out.mkdir(parents=True, exist_ok=True)
    nbytes = write_weights(state, out, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_config(m, special), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(special), indent=2) + "\n")
    return nbytes


def copy_tokenizer_files(data: Path, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "NOTICE"):
        shutil.copyfile(data / name, out / name)


# ---------------------------------------------------------------------------------------------- check


def load_written(directory: Path) -> Qwen3:
    """The torch model of a written directory, its bf16 weights in float32."""
    from safetensors.torch import load_file

    raw = json.loads((directory / "config.json").read_text())
    m = ModelSpec(hidden=raw["hidden_size"], layers=raw["num_hidden_layers"], heads=raw["num_attention_heads"],
                  kv_heads=raw["num_key_value_heads"], intermediate=raw["intermediate_size"],
                  vocab=raw["vocab_size"], head_dim=raw["head_dim"])
    state = {}
    for file in sorted(directory.glob("model*.safetensors")):
        state.update(load_file(str(file)))
    model = Qwen3(m)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


def check_against_reference(directory: Path, token_ids: list[int]) -> tuple[float, float]:
    """(max |logit difference|, max |logit|) between this script's model and tileinfer's numpy
    reference on the written directory, both in float32 from the same bf16 weights."""
    from tileinfer.model.checkpoint import Checkpoint
    from tileinfer.model.reference import ReferenceModel

    reference = ReferenceModel.from_checkpoint(Checkpoint.open(directory)).forward(np.asarray(token_ids))
    with torch.no_grad():
        ours = load_written(directory)(torch.tensor([token_ids])).squeeze(0).numpy()
    return float(np.abs(reference - ours).max()), float(np.abs(reference).max())


def check(out: Path, data: Path) -> None:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(data / "tokenizer.json"))
    text = "<|im_start|>user\nHello! What is a Python list?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text).ids
    for name in ("target", "draft"):
        if (out / name / "config.json").is_file():
            diff, scale = check_against_reference(out / name, ids)
            verdict = "ok" if diff <= 1e-2 else "MISMATCH"
            print(f"check {name}: {len(ids)} tokens, max |torch - tileinfer reference| = {diff:.2e} "
                  f"(logits up to {scale:.2f}): {verdict}")
            if diff > 1e-2:
                raise SystemExit(1)


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="build/demo-data", help="scripts/prepare_demo_data.py's output")
    parser.add_argument("--out", default="build/demo-model")
    parser.add_argument("--minutes", type=float, default=8.0, help="time budget of this call, writing included")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/state/ where a run left off")
    parser.add_argument("--models", default="target,draft", help="which to train, in order (target,draft)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows per source (64)")
    parser.add_argument("--target-epochs", type=float, default=None)
    parser.add_argument("--draft-epochs", type=float, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny models and a few dozen steps (CPU-sized)")
    parser.add_argument("--check", action="store_true",
                        help="compare the written models' logits with tileinfer's numpy reference (needs tileinfer)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    start = time.time()
    deadline = start + args.minutes * 60 - (WRITE_MARGIN_S if not args.smoke else 5)
    data, out = Path(args.data), Path(args.out)
    if not (data / "tokens.npz").is_file():
        parser.error(f"{data}/tokens.npz not found: run scripts/prepare_demo_data.py first")
    specs = SMOKE if args.smoke else MODELS
    overrides = {"target": args.target_epochs, "draft": args.draft_epochs}
    (out / "state").mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train-log.jsonl", "a" if args.resume else "w")

    def log(name: str, **fields) -> None:
        print(f"[{time.time() - start:6.0f}s] {name} " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
        log_file.write(json.dumps({"model": name, "time_s": round(time.time() - start, 1), **fields}) + "\n")
        log_file.flush()

    torch.backends.cuda.matmul.allow_tf32 = True
    if args.device == "cpu":
        torch.set_num_threads(1)    # CPU runs are smoke tests; intra-op threads crawl on a shared machine
    tokens = Tokens(data, args.device)
    print(f"data: {len(tokens.train):,} training tokens; held-out "
          + ", ".join(f"{k} {len(v):,}" for k, v in tokens.held_out.items()) + f"; device {args.device}")
    finished = True
    for name in args.models.split(","):
        m, t = specs[name]
        if overrides[name] is not None:
            t = dataclasses.replace(t, epochs=overrides[name])
        finished = train_one(name, list(specs).index(name), m, t, tokens, args, data, out, deadline, log) and finished
        if not finished:
            break
    if args.check:
        check(out, data)
    print("done" if finished else "time budget reached: run again with --resume to continue")
    return 0


def train_one(name: str, index: int, m: ModelSpec, t: TrainSpec, tokens: Tokens, args, data: Path, out: Path,
              deadline: float, log) -> bool:
    torch.manual_seed(args.seed * 1000 + index)
    model = Qwen3(m, t.dropout).to(args.device)
    optimizer = make_optimizer(model, t, fused=args.device.startswith("cuda"))
    total = math.ceil(t.epochs * len(tokens.train) / (t.batch * t.seq))
    run = Run(name, model, optimizer, total)
    state_file = out / "state" / f"{name}.pt"
    if args.resume and state_file.is_file():
        run.load(torch.load(state_file, map_location=args.device, weights_only=False))
    params = num_parameters(m)
    log(name, params=params, bf16_mb=round(2 * params / 1e6, 2), steps=total, start_step=run.step,
        spec=dataclasses.asdict(m), train=dataclasses.asdict(t))
    done = train(run, t, tokens, args, index, deadline, log)
    torch.save(run.state(), state_file)
    if done:
        special = json.loads((data / "manifest.json").read_text())["special_ids"]
        nbytes = write_model_dir(run.best_state, m, special, out / name)
        copy_tokenizer_files(data, out / name)
        log(name, wrote=name, weight_bytes=nbytes, best_step=run.best_step,
            best_held_out=round(run.best_loss, 4))
    return done


if __name__ == "__main__":
    sys.exit(main())
