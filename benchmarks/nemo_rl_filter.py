"""What NeMo-RL's policy worker spends filtering its HF stream with the checkpoint engine's target layout, and
what the worker then keeps, for reshard's NeMo-RL engine before and after it stopped answering a layout (issue 39,
item 6). No processes, no GPU: the filter's algorithm on the names, the plans compiled here.

NeMo-RL (commit 7ea279ab, the one tests/data/nemo_rl_checkpoint_engine.json records) filters the Megatron worker's
iterator in `MegatronCheckpointEngineSendMixin._checkpoint_engine_weight_iterator`
(nemo_rl/models/policy/workers/checkpoint_engine.py, lines 86-104) with `select_hf_weight_for_vllm_target`
(nemo_rl/models/generation/vllm/refit_layout.py, lines 74-117; its expert parser `parse_hf_expert_weight`, lines
43-71). `nemo_rl_filter` below is that code, re-typed line for line (nothing of NeMo-RL is imported): for every
tensor, `any(name.startswith(prefix) for prefix in missing_weight_prefixes)`, then the expert regex and a list
membership test. With a layout None the worker hands the engine its stream unfiltered.

Layouts compared, for policy worker 0 of T (and the worst worker for what is kept):
  - one prefix per tensor (the engine before this change, reshard/integrations/nemo_rl.py at cef64cb): every
    tensor the whole-model plan does not read from this worker is a missing prefix, its experts listed by id;
  - whole layers: the same, but a layer none of whose tensors this worker sends collapses into one prefix
    "model.layers.<i>." (the best a prefix list can do for a plan that spreads every layer over the workers);
  - None (now): NeMo-RL filters nothing; the engine drops what it does not send with one set lookup per tensor
    while checking the tensor against the model (`StreamNames.split` and the engine's own shape and dtype check:
    the engine's real code, run on meta tensors).

    .venv/bin/python benchmarks/nemo_rl_filter.py                      # DeepSeek-V3, 16 policy, 8 vLLM workers
    .venv/bin/python benchmarks/nemo_rl_filter.py --policy 64 --rollout 16 --full

The quadratic filter is timed on every `--sample`-th name (its cost per name is the same whatever the sample) and
scaled to the whole stream; --full times it on every name.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# --- NeMo-RL's filter, re-typed from refit_layout.py (lines 43-117) and checkpoint_engine.py (lines 86-104) ------
_HF_EXPERT_WEIGHT_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert_id>\d+)\."
                                  r"(?P<projection>gate_proj|up_proj|down_proj)\.weight$")
_HF_PROJECTION_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def parse_hf_expert_weight(name: str) -> tuple[str, int, str, int] | None:
    match = _HF_EXPERT_WEIGHT_RE.match(name)
    if match is None:
        return None
    shard_id = _HF_PROJECTION_SHARDS[match.group("projection")]
    leaf = "w2_weight" if shard_id == "w2" else "w13_weight"
    return (f"{match.group('prefix')}.routed_experts.{leaf}", int(match.group("expert_id")), shard_id,
            1 if shard_id == "w2" else 0)


def select_hf_weight_for_vllm_target(name: str, tensor: Any, *, target_layout: dict[str, Any]) -> Any:
    if any(name.startswith(prefix) for prefix in target_layout["missing_weight_prefixes"]):
        return None
    expert_weight = parse_hf_expert_weight(name)
    if expert_weight is None:
        return tensor
    param_layout = target_layout["expert_params"].get(expert_weight[0])
    if param_layout is None:
        return None
    local_expert_ids = param_layout["local_expert_ids"]
    if local_expert_ids is not None and expert_weight[1] not in local_expert_ids:
        return None
    if param_layout["tp_size"] == 1:
        return tensor
    raise NotImplementedError("tp_size > 1: this engine never asks NeMo-RL to slice experts")


def nemo_rl_filter(weights: Iterable[tuple[str, Any]], target_layout: dict[str, Any] | None
                   ) -> Iterable[tuple[str, Any]]:
    if target_layout is None:
        return weights
    return ((name, selected) for name, tensor in weights
            if (selected := select_hf_weight_for_vllm_target(name, tensor, target_layout=target_layout)) is not None)


# --- the layouts ---------------------------------------------------------------------------------------------
_EXPERT = re.compile(r"^(?P<block>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def per_tensor_layout(names: list[str], needed: set[str]) -> dict[str, Any]:
    """The engine's answer before this change (cef64cb's get_target_weight_layout): one prefix per unread tensor
    (a name that is a prefix of a read one cannot be listed; no model here has one)."""
    import bisect

    kept = sorted(needed)

    def prefixes_any(name: str) -> bool:
        i = bisect.bisect_right(kept, name)
        return i < len(kept) and kept[i].startswith(name)

    missing = [n for n in sorted(names) if n not in needed and not prefixes_any(n)]
    return {"expert_params": _expert_params(needed), "missing_weight_prefixes": missing}


def layer_layout(names: list[str], needed: set[str]) -> dict[str, Any]:
    """Whole layers this worker reads nothing of as one prefix each; the rest one prefix per unread tensor."""
    layers: dict[str, list[str]] = {}
    for n in names:
        m = _LAYER.match(n)
        layers.setdefault(m.group(0) if m else n, []).append(n)
    missing = []
    for prefix, members in layers.items():
        unread = [n for n in members if n not in needed]
        missing += [prefix] if len(unread) == len(members) and prefix.endswith(".") else unread
    return {"expert_params": _expert_params(needed), "missing_weight_prefixes": missing}


def _expert_params(needed: set[str]) -> dict[str, Any]:
    experts: dict[str, set[int]] = {}
    for name in needed:
        m = _EXPERT.match(name)
        if m:
            leaf = "w2_weight" if m["proj"] == "down_proj" else "w13_weight"
            experts.setdefault(f"{m['block']}.routed_experts.{leaf}", set()).add(int(m["expert"]))
    return {p: {"tp_rank": 0, "tp_size": 1, "local_expert_ids": sorted(ids)} for p, ids in sorted(experts.items())}


def whole_plan_needed(spec: Any, policy: int, rollout: int) -> list[set[str]]:
    """What each policy worker sent before this change: the whole model's plan, source rank p on worker p."""
    from reshard.layouts import HfLayout
    from reshard.planner.cache import cached_plan

    plan = cached_plan(HfLayout(model=spec, replicas=policy), HfLayout(model=spec, replicas=rollout))
    table = plan.src_tensors
    return [{table.name(int(t)) for t in set(plan.ops_sent_by(p)["src_tensor"].tolist())} for p in range(policy)]


def grouped_needed(spec: Any, policy: int, rollout: int, bucket: int) -> tuple[list[set[str]], list[int]]:
    """What each policy worker sends now (integrations.groups: one plan per bucket-sized group, balanced
    bindings), and per worker the bytes of its two buckets (its largest share of a group, twice)."""
    from reshard.integrations.groups import group_bindings, group_plans, tensor_bytes, tensor_groups

    groups = tensor_groups(spec, bucket)
    plans = group_plans(spec, policy, rollout, groups)
    needed: list[set[str]] = [set() for _ in range(policy)]
    share = [[0, 0] for _ in range(policy)]
    for k, (plan, binding) in enumerate(zip(plans, group_bindings(plans, policy, rollout))):
        for s in range(policy):
            p = binding.src[s]
            mine = {plan.src_tensors.name(int(t)) for t in set(plan.ops_sent_by(s)["src_tensor"].tolist())}
            needed[p] |= mine
            share[p][k % 2] = max(share[p][k % 2], sum(tensor_bytes(spec, n) for n in mine))
    return needed, [sum(s) for s in share]


# --- measuring -----------------------------------------------------------------------------------------------
def time_filter(names: list[str], layout: dict[str, Any] | None, needed: set[str], sample: int
                ) -> tuple[float, int]:
    """Seconds NeMo-RL's filter takes over the whole stream (timed on every `sample`-th name, scaled), and how
    many names it lets through (checked on the timed ones: exactly those the worker sends, or every one)."""
    subset = names[::sample]
    start = time.perf_counter()
    through = [n for n, _ in nemo_rl_filter(((n, n) for n in subset), layout)]
    seconds = (time.perf_counter() - start) * len(names) / len(subset)
    want = subset if layout is None else [n for n in subset if n in needed]
    assert through == want, f"the filter let {len(through)} of {len(subset)} through, the worker sends {len(want)}"
    return seconds, len(names) if layout is None else len(needed)


def time_engine_checks(config: str, names: list[str], needed: set[str], bucket: int) -> float:
    """Seconds the engine's own per-tensor work in send_weights takes over the stream when nothing was filtered:
    StreamNames.split, the check of name, shape and dtype, and the set lookup that drops what it does not send
    (its real code, on meta tensors)."""
    import torch

    from reshard.integrations.nemo_rl import ReshardCheckpointEngine

    engine = ReshardCheckpointEngine(bucket, model=config, device="cpu")
    where = {name: k for k, group in enumerate(engine.groups) for name in group}
    tensors = {}
    for n in names:
        shape, dtype = engine._shape(n)
        tensors[n] = torch.empty(shape, dtype=dtype, device="meta")
    seen: set[str] = set()
    kept = 0
    start = time.perf_counter()
    for name in names:
        for hf, t in engine._names.split(name, tensors[name]):
            engine._check(hf, t, where, seen)
            kept += hf in needed
    seconds = time.perf_counter() - start
    assert kept == len(needed)
    return seconds


def row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "examples/configs/deepseek-v3.json"))
    p.add_argument("--policy", type=int, default=16, help="NeMo-RL policy workers (T)")
    p.add_argument("--rollout", type=int, default=8, help="vLLM workers (R)")
    p.add_argument("--bucket", type=int, default=4 << 30, help="bytes (NeMo-RL: 0.05 of an 80 GiB GPU)")
    p.add_argument("--sample", type=int, default=20, help="time the quadratic filter on every n-th name")
    p.add_argument("--full", action="store_true", help="time it on every name (minutes for DeepSeek-V3)")
    a = p.parse_args(argv)
    from reshard.integrations.groups import tensor_bytes
    from reshard.layouts import ModelSpec

    spec = ModelSpec.from_hf_config(a.config)
    names = [t.name for t in spec.tensors]
    size = {n: tensor_bytes(spec, n) for n in names}
    sample = 1 if a.full else a.sample
    print(f"{spec.family}: {len(names):,} tensors, {sum(size.values()) / 2**30:,.1f} GiB; {a.policy} policy workers "
          f"-> {a.rollout} vLLM workers; NeMo-RL's filter timed on {'every' if sample == 1 else f'every {sample}th'} "
          f"name\n")
    t0 = time.perf_counter()
    before = whole_plan_needed(spec, a.policy, a.rollout)
    now, buckets = grouped_needed(spec, a.policy, a.rollout, a.bucket)
    plans_s = time.perf_counter() - t0
    layouts: list[tuple[str, Callable[[list[str], set[str]], dict[str, Any] | None], list[set[str]]]] = [
        ("one prefix per tensor (before)", per_tensor_layout, before),
        ("whole layers", layer_layout, before),
        ("None (now)", lambda names, needed: None, now),
    ]
    widths = [32, 10, 12, 12, 12, 14, 14]
    print(row(["layout of policy worker 0", "prefixes", "filter s", "passed", "kept", "kept GiB", "worst kept GiB"],
              widths))
    for label, make, needed in layouts:
        layout = make(names, needed[0])
        seconds, passed = time_filter(names, layout, needed[0], sample)
        if layout is None:
            seconds = time_engine_checks(a.config, names, needed[0], a.bucket)
            label += " + engine checks"
        kept = [sum(size[n] for n in need) for need in needed]
        prefixes = "-" if layout is None else f"{len(layout['missing_weight_prefixes']):,}"
        print(row([label, prefixes, f"{seconds:.2f}", f"{passed:,}", f"{len(needed[0]):,}",
                   f"{kept[0] / 2**30:.1f}", f"{max(kept) / 2**30:.1f}"], widths))
    print(f"\nkept: tensors the plans read from the worker, sent over one refit (before: all held until the stream "
          f"ended; now: moved group by group, at most two buckets held: worker 0 {buckets[0] / 2**30:.2f} GiB, worst "
          f"{max(buckets) / 2**30:.2f} GiB). Plans compiled in {plans_s:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
