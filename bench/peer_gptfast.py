# TileInfer's benchmark peer, Apache-2.0 like the project. Needs PyTorch, which is never a dependency of the package.
"""Peer baseline: a gpt-fast-style Qwen3 / Apertus in PyTorch (static KV cache, torch.compile reduce-overhead).
Random weights; measures decode tokens/s. Usage: peer_gptfast.py MODEL BATCH CONTEXT [NEW]
Apertus: ungated MLP (up -> xIELU -> down), vocabulary 131,072, untied head, QK-norm as Qwen3."""
import sys, time, json, os, math, torch, torch.nn as nn, torch.nn.functional as F
CFG = {
 "qwen3-0.6b": dict(d=1024, ff=3072, L=28, H=16, KV=8, hd=128, tie=True),
 "qwen3-4b": dict(d=2560, ff=9728, L=36, H=32, KV=8, hd=128, tie=True),
 "qwen3-8b": dict(d=4096, ff=12288, L=36, H=32, KV=8, hd=128, tie=False),
 "apertus-8b": dict(d=4096, ff=21504, L=32, H=32, KV=8, hd=128, tie=False, V=131072, act="xielu", eps=1e-5),
}
V = 151936
def xielu(x, ap=0.8, an=0.8, beta=0.5, eps=-1e-6):  # Apertus' activation with its initial scalars
    ap, an = math.log1p(math.exp(ap)), beta + math.log1p(math.exp(an))  # softplus
    return torch.where(x > 0, ap * x * x + beta * x, (torch.expm1(torch.clamp(x, max=eps)) - x) * an + beta * x)
class Layer(nn.Module):
    def __init__(s, c, B, S):
        super().__init__(); d, H, KV, hd, ff = c["d"], c["H"], c["KV"], c["hd"], c["ff"]
        s.H, s.KV, s.hd, s.gated = H, KV, hd, c.get("act") != "xielu"; eps = c.get("eps", 1e-6)
        s.qkv = nn.Linear(d, (H + 2 * KV) * hd, bias=False); s.o = nn.Linear(H * hd, d, bias=False)
        s.gu = nn.Linear(d, (2 if s.gated else 1) * ff, bias=False); s.down = nn.Linear(ff, d, bias=False)
        s.n1 = nn.RMSNorm(d, eps=eps); s.n2 = nn.RMSNorm(d, eps=eps); s.qn = nn.RMSNorm(hd, eps=eps); s.kn = nn.RMSNorm(hd, eps=eps)
        s.register_buffer("kc", torch.zeros(B, KV, S, hd)); s.register_buffer("vc", torch.zeros(B, KV, S, hd))
    def forward(s, x, cos, sin, pos, mask):
        B, T, _ = x.shape
        q, k, v = s.qkv(s.n1(x)).split([s.H * s.hd, s.KV * s.hd, s.KV * s.hd], -1)
        q = s.qn(q.view(B, T, s.H, s.hd)).transpose(1, 2); k = s.kn(k.view(B, T, s.KV, s.hd)).transpose(1, 2); v = v.view(B, T, s.KV, s.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        s.kc.index_copy_(2, pos, k); s.vc.index_copy_(2, pos, v)
        y = F.scaled_dot_product_attention(q, s.kc, s.vc, attn_mask=mask, enable_gqa=True)
        x = x + s.o(y.transpose(1, 2).reshape(B, T, -1))
        if not s.gated: return x + s.down(xielu(s.gu(s.n2(x))))
        g, u = s.gu(s.n2(x)).chunk(2, -1)
        return x + s.down(F.silu(g) * u)
def rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
class Model(nn.Module):
    def __init__(s, c, B, S):
        super().__init__(); Vc = c.get("V", V); s.emb = nn.Embedding(Vc, c["d"]); s.layers = nn.ModuleList(Layer(c, B, S) for _ in range(c["L"])); s.norm = nn.RMSNorm(c["d"], eps=c.get("eps", 1e-6))
        s.head = nn.Linear(c["d"], Vc, bias=False); s.S = S
        if c["tie"]: s.head.weight = s.emb.weight  # Qwen3-0.6B and -4B tie the output head to the embedding
        inv = 1.0 / (1e6 ** (torch.arange(0, c["hd"], 2).float() / c["hd"])); f = torch.outer(torch.arange(S).float(), inv)
        s.register_buffer("cos", f.cos()); s.register_buffer("sin", f.sin())
        s.register_buffer("causal", torch.tril(torch.ones(S, S, dtype=torch.bool)))
    def forward(s, ids, pos):
        x = s.emb(ids); cos, sin = s.cos[pos][None, None].to(x.dtype), s.sin[pos][None, None].to(x.dtype)
        mask = s.causal[pos][None, None]
        for l in s.layers: x = l(x, cos, sin, pos, mask)
        return s.head(s.norm(x[:, -1:]))
def main():
    name, B, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]); new = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    c = CFG[name]; S = ctx + new + 8
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Model(c, B, S).to(torch.bfloat16).eval()
        for p in m.parameters(): p.data.normal_(0, 0.02)
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    ids = torch.randint(0, c.get("V", V), (B, ctx), device="cuda")
    decode = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        prefill = None
        if ctx <= 4096:  # long contexts: decode speed does not depend on what the cache holds
            t = time.perf_counter(); logits = m(ids, torch.arange(ctx, device="cuda")); torch.cuda.synchronize(); prefill = time.perf_counter() - t
            tok = logits.argmax(-1)
        else:
            tok = ids[:, -1:]
        def run(n, start):
            nonlocal tok
            for i in range(n):
                pos = torch.tensor([start + i], device="cuda")
                torch.compiler.cudagraph_mark_step_begin()
                tok = decode(tok, pos).argmax(-1)
        t = time.perf_counter(); run(3, ctx); torch.cuda.synchronize(); warm = time.perf_counter() - t
        t = time.perf_counter(); run(new, ctx + 3); torch.cuda.synchronize(); dt = time.perf_counter() - t
    kv_bytes = 2 * c["L"] * c["KV"] * c["hd"] * 2 * S * B
    r = dict(peer="gpt-fast-style torch.compile", model=name, batch=B, context=ctx, decode_tok_s_per_seq=new / dt, decode_tok_s_total=B * new / dt,
             ms_per_step=dt / new * 1e3, weight_GB=nbytes / 1e9, kv_read_GB=kv_bytes / 1e9, warm_s=warm, prefill_s=prefill,
             achieved_TBps=(nbytes + kv_bytes) / (dt / new) / 1e12)
    print(json.dumps(r)); open(os.path.join(os.environ.get("OUT", "/tmp"), f"peer_{name}_{B}_{ctx}.json"), "w").write(json.dumps(r))
main()
