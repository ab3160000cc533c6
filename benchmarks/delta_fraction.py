"""How many bf16 elements change per optimizer step at RL learning rates, per tensor kind (issue 41, item 1).

The trainer keeps fp32 master weights and casts them to bf16 for the refit, so an engine receives an element as
changed when its bf16 value (bit pattern) differs from the previous refit's bf16 value. This script trains a model
with AdamW on a language-modelling loss for a few warm-up steps and then some measured steps, casts every parameter
to bf16 after every step, compares with the previous cast and prints, per tensor kind (attention, mlp, experts,
router, norms, embeddings, lm_head) and overall:

- elements, and the fraction changed per step: mean, min and max over the measured steps;
- what the changed elements cost on the wire, relative to sending the tensor dense (2 bytes an element):
  idx32+v = int32 indices + bf16 values (6 bytes per changed element), bitmap+v = one bit per element + bf16
  values of the changed ones (n/8 + 2c bytes), best/blk = the cheapest of dense, idx32+v, bitmap+v chosen per
  64 KiB block (a block with no change costs nothing; block headers are not counted);
- untouched = the share of the bytes that lie in 64 KiB blocks (32,768 bf16 elements of one tensor's flattened
  storage; a smaller tensor, and a tensor's remainder, is one block) with no changed element: what skipping
  untouched blocks saves;
- 1-ulp = the share of changed elements whose bf16 bit pattern moved by exactly one (one unit in the last place).

Models (one of):
  --megatron  a small megatron-core GPT (Qwen3-MoE shaped: experts in every layer, or dense with --experts 0)
              built by reshard.testing.megatron_cpu on CPU, one process under gloo; fp32 parameters are the master
              weights. Needs megatron-core (reshard[megatron]).
  --torch     a plain PyTorch decoder: GQA attention with q/k RMSNorm and RoPE, gated-SiLU MLP layers alternating
              with top-k MoE layers (experts stored stacked, [E, 2F, H] and [E, H, F]), RMSNorm, untied embeddings
              and lm_head; fp32 parameters, forward under bf16 autocast on CUDA. Imports only torch.

Data: a structured synthetic corpus, not random tokens: a Markov chain over the vocabulary whose unigram draws follow
Zipf(1.1); each token has 4 fixed successors (drawn from that Zipf law) that follow it with probability 0.9, else a
fresh Zipf draw. Every step trains on a fresh batch; every configuration sees the same batches and the same initial
weights (seed). Initial weights: normal(0, 0.02), output projections normal(0, 0.02 / sqrt(2 * layers)), norms
1 + 0.2 * normal (megatron_cpu.set_norms' convention), so the figures are of a freshly initialised model's early
steps, not of a pretrained one's.

    python benchmarks/delta_fraction.py --megatron --lr 1e-6 3e-6 1e-5 --weight-decay 0.0 0.01 --json out.json
    python benchmarks/delta_fraction.py --torch --device cuda --json out.json   # ~1.6B parameters by default

Steps: --warmup steps are trained first (their figures are kept in the JSON, per step, as "early"), then --steps
measured steps make the table. --updates-per-refit K compares the bf16 cast every K optimizer steps instead of every
step (several optimizer steps between refits).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK_BYTES = 64 * 1024
BLOCK = BLOCK_BYTES // 2  # bf16 elements in one 64 KiB block
KINDS = ("attention", "mlp", "experts", "router", "norms", "embeddings", "lm_head", "other")

MEGATRON_DEFAULTS = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768, experts=8, moe_ffn=256,
                         topk=2, vocab=8192, seq_len=128, batch=4)
TORCH_DEFAULTS = dict(hidden=2048, layers=16, heads=16, kv_heads=4, head_dim=128, ffn=5632, experts=8, moe_ffn=1408,
                      topk=2, vocab=151936, seq_len=1024, batch=8)


def kind_of(name: str) -> str:
    n = name.lower()
    if "norm" in n:
        return "norms"
    if "router" in n:
        return "router"
    if "expert" in n:
        return "experts"
    if "embed" in n:
        return "embeddings"
    if "output_layer" in n or "lm_head" in n:
        return "lm_head"
    if "attention" in n or "attn" in n:
        return "attention"
    if "mlp" in n:
        return "mlp"
    return "other"


# --- data ---------------------------------------------------------------------------------------------------------

class MarkovCorpus:
    """Token sequences from a sparse Markov chain with Zipfian unigram draws (see the module docstring)."""

    def __init__(self, vocab: int, seed: int, successors: int = 4, follow: float = 0.9, zipf: float = 1.1):
        self.gen = torch.Generator().manual_seed(seed)
        self.zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** zipf
        self.zipf /= self.zipf.sum()
        perm = torch.randperm(vocab, generator=self.gen)  # frequent tokens spread over the embedding's rows
        self.rank_to_token = perm
        self.succ = perm[torch.multinomial(self.zipf, vocab * successors, replacement=True,
                                           generator=self.gen)].view(vocab, successors)
        self.successors, self.follow = successors, follow

    def draw(self, n: int) -> torch.Tensor:
        return self.rank_to_token[torch.multinomial(self.zipf, n, replacement=True, generator=self.gen)]

    def batch(self, batch: int, seq: int) -> torch.Tensor:
        """[batch, seq + 1] int64 token ids (inputs and next-token labels)."""
        follow = torch.rand(batch, seq + 1, generator=self.gen) < self.follow
        which = torch.randint(self.successors, (batch, seq + 1), generator=self.gen)
        fresh = self.draw(batch * (seq + 1)).view(batch, seq + 1)
        out = torch.empty(batch, seq + 1, dtype=torch.int64)
        cur = fresh[:, 0]
        out[:, 0] = cur
        for t in range(1, seq + 1):
            cur = torch.where(follow[:, t], self.succ[cur, which[:, t]], fresh[:, t])
            out[:, t] = cur
        return out


# --- measuring ----------------------------------------------------------------------------------------------------

class Tracker:
    """Keeps the previous bf16 cast of every parameter and counts, per kind, what changed since."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self.params = [(name, kind_of(name), p) for name, p in named]
        self.prev = [self._cast(p) for _, _, p in self.params]

    @staticmethod
    def _cast(p: torch.Tensor) -> torch.Tensor:
        return p.detach().to(torch.bfloat16).view(torch.int16).reshape(-1).clone()

    def compare(self) -> dict[str, dict[str, float]]:
        """Per kind: elements, changed, dense/idx32/bitmap/best bytes, blocks, untouched blocks, one-ulp changes."""
        acc: dict[str, list] = {}
        for i, (_, kind, p) in enumerate(self.params):
            cur = self._cast(p)
            prev = self.prev[i]
            diff = cur != prev
            n = cur.numel()
            full = n // BLOCK
            counts = []
            if full:
                counts.append(diff[:full * BLOCK].view(full, BLOCK).sum(1))
            if n % BLOCK:
                counts.append(diff[full * BLOCK:].sum().view(1))
            per_block = torch.cat(counts).to(torch.int64)
            sizes = torch.full_like(per_block, BLOCK)
            if n % BLOCK:
                sizes[-1] = n % BLOCK
            c = per_block.sum()
            best = torch.minimum(torch.minimum(2 * sizes, 6 * per_block), (sizes + 7) // 8 + 2 * per_block)
            best = torch.where(per_block == 0, torch.zeros_like(best), best).sum()
            untouched = sizes[per_block == 0].sum()
            moved = (cur[diff].to(torch.int32) - prev[diff].to(torch.int32)).abs()
            one_ulp = (moved == 1).sum()
            stats = torch.stack([c, best, untouched, one_ulp]).tolist()  # one sync per tensor
            row = acc.setdefault(kind, [0] * 9)
            c_, best_, untouched_, one_ = stats
            row[0] += n
            row[1] += c_
            row[2] += 2 * n
            row[3] += 6 * c_
            row[4] += (n + 7) // 8 + 2 * c_
            row[5] += best_
            row[6] += per_block.numel()
            row[7] += untouched_  # elements in untouched blocks
            row[8] += one_
            self.prev[i] = cur
        keys = ("elements", "changed", "dense_bytes", "idx32_bytes", "bitmap_bytes", "best_block_bytes", "blocks",
                "untouched_block_elements", "one_ulp")
        out = {kind: dict(zip(keys, row)) for kind, row in acc.items()}
        out["overall"] = {k: sum(out[kind][k] for kind in acc) for k in keys}
        return out


def summarise(steps: list[dict]) -> dict[str, dict[str, float]]:
    """Per kind, over the given steps: fraction changed (mean, min, max), bytes relative to dense (means),
    untouched blocks (mean), one-ulp share (of all changed elements)."""
    out = {}
    for kind in [*KINDS, "overall"]:
        rows = [s[kind] for s in steps if kind in s]
        if not rows:
            continue
        fr = [r["changed"] / r["elements"] for r in rows]
        changed = sum(r["changed"] for r in rows)
        out[kind] = dict(
            elements=rows[0]["elements"], frac_mean=sum(fr) / len(fr), frac_min=min(fr), frac_max=max(fr),
            idx32_rel=sum(r["idx32_bytes"] / r["dense_bytes"] for r in rows) / len(rows),
            bitmap_rel=sum(r["bitmap_bytes"] / r["dense_bytes"] for r in rows) / len(rows),
            best_block_rel=sum(r["best_block_bytes"] / r["dense_bytes"] for r in rows) / len(rows),
            untouched_bytes=sum(r["untouched_block_elements"] / r["elements"] for r in rows) / len(rows),
            blocks=rows[0]["blocks"],
            one_ulp_share=(sum(r["one_ulp"] for r in rows) / changed) if changed else float("nan"))
    return out


def fmt_count(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}" if n < 100 * div else f"{n / div:.0f}{unit}"
    return str(n)


def table(summary: dict[str, dict[str, float]]) -> str:
    lines = ["| kind | elements | changed/step mean (min–max) | idx32+v | bitmap+v | best/blk | in untouched 64K blk "
             "| 1-ulp |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for kind, s in summary.items():
        lines.append(f"| {kind} | {fmt_count(s['elements'])} | {100 * s['frac_mean']:.3f}% "
                     f"({100 * s['frac_min']:.3f}–{100 * s['frac_max']:.3f}%) | {s['idx32_rel']:.3f} | "
                     f"{s['bitmap_rel']:.3f} | {s['best_block_rel']:.3f} | {100 * s['untouched_bytes']:.1f}% "
                     f"of {s['blocks']} | {100 * s['one_ulp_share']:.0f}% |")
    return "\n".join(lines)


# --- the plain PyTorch decoder (torch only) -----------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = nn.Linear(h, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, h, bias=False)
        self.q_norm, self.k_norm = RMSNorm(head_dim), RMSNorm(head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], dim=-1)
        q = rope(self.q_norm(q.view(b, s, self.heads, self.head_dim)), cos, sin).transpose(1, 2)
        k = rope(self.k_norm(k.view(b, s, self.kv_heads, self.head_dim)), cos, sin).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(h, 2 * ffn, bias=False)  # gate and up
        self.fc2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, h: int, ffn: int, experts: int, topk: int):
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(h, experts, bias=False)
        self.experts_w13 = nn.Parameter(torch.empty(experts, 2 * ffn, h))
        self.experts_w2 = nn.Parameter(torch.empty(experts, h, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weight, idx = probs.topk(self.topk, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.experts_w13.shape[0]):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up = (x[tok] @ self.experts_w13[e].t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.experts_w2[e].t()
            out.index_add_(0, tok, (y * weight[tok, slot, None]).to(out.dtype))
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, a: argparse.Namespace, moe: bool):
        super().__init__()
        self.attn_norm = RMSNorm(a.hidden)
        self.attn = Attention(a.hidden, a.heads, a.kv_heads, a.head_dim)
        self.mlp_norm = RMSNorm(a.hidden)
        self.mlp = MoE(a.hidden, a.moe_ffn, a.experts, a.topk) if moe else MLP(a.hidden, a.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, a: argparse.Namespace):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.hidden)
        # MoE in every second layer (every layer with --moe-every 1; none with --experts 0)
        self.layers = nn.ModuleList(Block(a, moe=a.experts > 0 and i % a.moe_every == a.moe_every - 1)
                                    for i in range(a.layers))
        self.final_norm = RMSNorm(a.hidden)
        self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)
        self.head_dim, self.rope_base = a.head_dim, 1_000_000.0

    def init_weights(self, seed: int, layers: int) -> None:
        gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, device=p.device))
                elif name.endswith(("proj.weight", "fc2.weight", "experts_w2")):
                    p.normal_(0.0, 0.02 / math.sqrt(2 * layers), generator=gen)
                else:
                    p.normal_(0.0, 0.02, generator=gen)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        inv = 1.0 / self.rope_base ** (torch.arange(0, self.head_dim, 2, device=tokens.device) / self.head_dim)
        ang = torch.arange(s, device=tokens.device)[:, None] * inv[None]
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.final_norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def torch_model(a: argparse.Namespace, device: torch.device):
    with torch.device(device):
        model = Decoder(a)
    model.init_weights(a.seed, a.layers)
    model.train()

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return model(batch[:, :-1], batch[:, 1:])

    return list(model.named_parameters()), loss_fn, None


# --- the megatron-core model (lazy: reshard and megatron only here) ----------------------------------------------

def megatron_model(a: argparse.Namespace, device: torch.device):
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    warnings.simplefilter("ignore")  # megatron-core warns about missing Apex / TE on every import path
    from reshard.ports import free_port
    from reshard.adapters.megatron.forward import causal_mask
    from reshard.testing.megatron_cpu import TinyGPT, apply_cpu_patches, build_model, init_parallel

    if device.type != "cpu":
        raise SystemExit("--megatron runs on CPU (reshard.testing.megatron_cpu)")
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), CUDA_VISIBLE_DEVICES="")
        dist.init_process_group("gloo", rank=0, world_size=1)
        apply_cpu_patches()
    init_parallel()
    tiny = TinyGPT(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                   num_query_groups=a.kv_heads, head_dim=a.head_dim, ffn_hidden_size=a.ffn, vocab_size=a.vocab,
                   padded_vocab_size=a.vocab, num_experts=a.experts, moe_ffn_hidden_size=a.moe_ffn, topk=a.topk,
                   seed=a.seed)
    model = build_model(tiny)[0].train()
    mask = causal_mask(a.seq_len)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        tokens, labels = batch[:, :-1], batch[:, 1:].contiguous()
        pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        return model(tokens, pos, mask.expand(tokens.shape[0], 1, -1, -1), labels=labels).mean()

    return list(model.named_parameters()), loss_fn, tiny


# --- one configuration ---------------------------------------------------------------------------------------------

def run_one(a: argparse.Namespace, lr: float, wd: float, device: torch.device) -> dict:
    torch.manual_seed(a.seed)
    named, loss_fn, _ = (megatron_model if a.megatron else torch_model)(a, device)
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    corpus = MarkovCorpus(a.vocab, a.seed + 1)
    tracker = Tracker(named)
    steps, losses, times = [], [], []
    total = (a.warmup + a.steps) * a.updates_per_refit
    for i in range(1, total + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(corpus.batch(a.batch, a.seq_len))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if i % a.updates_per_refit == 0:
            steps.append(tracker.compare())
            refit = i // a.updates_per_refit
            o = steps[-1]["overall"]
            print(f"  lr {lr:g} wd {wd:g} refit {refit:3d}{' (warm-up)' if refit <= a.warmup else ''}: loss "
                  f"{losses[-1]:.4f}, changed {100 * o['changed'] / o['elements']:.4f}%, step {times[-1]:.2f} s",
                  flush=True)
    measured = steps[a.warmup:]
    result = dict(lr=lr, weight_decay=wd, summary=summarise(measured), per_step=steps, losses=losses,
                  step_seconds=times, first_step=summarise(steps[:1]))
    del named, params, opt, tracker, loss_fn
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--megatron", action="store_true", help="megatron-core GPT on CPU (reshard's harness)")
    which.add_argument("--torch", action="store_true", help="plain PyTorch decoder (torch only)")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    p.add_argument("--weight-decay", type=float, nargs="+", default=[0.0, 0.01])
    p.add_argument("--warmup", type=int, default=10, help="refits trained before the measured ones")
    p.add_argument("--steps", type=int, default=5, help="measured refits")
    p.add_argument("--updates-per-refit", type=int, default=1, help="optimizer steps between two bf16 casts")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int)
    for name in ("hidden", "layers", "heads", "kv-heads", "head-dim", "ffn", "experts", "moe-ffn", "topk", "vocab"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--moe-every", type=int, default=2, help="--torch: every n-th layer is MoE")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    for k, v in (MEGATRON_DEFAULTS if a.megatron else TORCH_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    config = {k: v for k, v in vars(a).items() if k != "json"}
    print(f"model {'megatron' if a.megatron else 'torch'} on {dev_name}, torch {torch.__version__}: {config}")

    results = []
    for lr in a.lr:
        for wd in a.weight_decay:
            results.append(run_one(a, lr, wd, device))
            r = results[-1]
            print(f"\n### lr {lr:g}, weight decay {wd:g}: {a.steps} refits after {a.warmup} warm-up refits "
                  f"({a.updates_per_refit} optimizer step(s) each), "
                  f"{sum(r['step_seconds']) / len(r['step_seconds']):.2f} s/step, "
                  f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
                  + (f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
                     if device.type == "cuda" else "") + "\n")
            print(table(r["summary"]))
            ov = [s["overall"]["changed"] / s["overall"]["elements"] for s in r["per_step"]]
            print("\noverall changed per refit, from the first: " + " ".join(f"{100 * f:.3f}%" for f in ov) + "\n",
                  flush=True)
            if a.json:  # after every configuration, so a run cut short keeps what it measured
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps(dict(config=config, device=dev_name, torch=torch.__version__,
                                                  results=results)))
    print("\nsummary (overall, measured refits): lr | wd | changed mean (min–max) | idx32+v | bitmap+v | best/blk | "
          "untouched blk")
    for r in results:
        s = r["summary"]["overall"]
        print(f"  {r['lr']:g} | {r['weight_decay']:g} | {100 * s['frac_mean']:.3f}% ({100 * s['frac_min']:.3f}–"
              f"{100 * s['frac_max']:.3f}%) | {s['idx32_rel']:.3f} | {s['bitmap_rel']:.3f} | "
              f"{s['best_block_rel']:.3f} | {100 * s['untouched_bytes']:.1f}%")


if __name__ == "__main__":
    main()
