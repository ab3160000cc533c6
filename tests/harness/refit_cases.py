"""Refit cases for multi-process tests (gloo on CPU, NCCL on GPUs): drawn from the property generators or
named, written as `refit_jobs` JSON, and their results checked. Shared by every backend's test so that each
runs the same kinds of plans, bindings and executor options."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from reshard.executors.binding import Binding
from reshard.layouts import ModelSpec
from reshard.testing.strategies import refit_plans


def examples(strategy: st.SearchStrategy, n: int) -> list:
    """n examples of a strategy, the same on every run (hypothesis drives the draw; processes run them)."""
    out: list = []

    @settings(max_examples=n, database=None, derandomize=True, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out


@st.composite
def random_cases(draw, world: int):
    """(plan, binding, group members or None for the world, executor options, seed) for a world of `world`."""
    plan = draw(refit_plans())
    members = draw(st.one_of(st.none(), st.lists(st.integers(0, world - 1), min_size=2, max_size=world,
                                                  unique=True).map(sorted)))
    n = len(members) if members is not None else world
    S, D = plan.src.num_ranks, plan.dst.num_ranks
    shape = draw(st.sampled_from(["disjoint", "colocated", "random"]))
    if shape == "disjoint" and S + D <= n:
        binding = Binding.disjoint(S, D)
    elif shape == "colocated" and max(S, D) <= n:
        binding = Binding.colocated(S, D)
    else:  # ranks spread over the group's processes; a process may play several ranks of a side
        binding = Binding(tuple(draw(st.lists(st.integers(0, n - 1), min_size=S, max_size=S))),
                          tuple(draw(st.lists(st.integers(0, n - 1), min_size=D, max_size=D))))
    total = int((plan.ops["rows"] * plan.ops["cols"]).sum()) * plan.itemsize
    mode = draw(st.sampled_from([{}, {"in_place": True}, {"undo": True}]))  # staged, in place, undo
    options = {**mode, "timeout": 60.0,
               # small buckets split ops at odd places; about 20 rounds at most keeps a case quick
               "bucket_bytes": max(draw(st.sampled_from([4, 12, 256, 4096, 1 << 20])), total // 20),
               # runs sent from / received into the tensors unpacked: most, some, or only whole messages
               "direct_bytes": draw(st.sampled_from([2, 64, None])),
               # rounds spread over extra communicators of the group (round r on lane r mod lanes); None: default
               "lanes": draw(st.sampled_from([None, 1, 2, 3]))}
    if draw(st.booleans()):
        options["memory_cap"] = max(options.pop("bucket_bytes") * 2, 64)
    if draw(st.booleans()):  # a group made over a store of its own (comm.StoreComm), outside the world
        options["store"] = True
    return plan, binding, members, options, draw(st.integers(0, 2**16))


def tiny_spec() -> ModelSpec:
    return ModelSpec(family="qwen3", hidden_size=16, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=4, intermediate_size=24, vocab_size=100, qk_norm=True)


def tiny_deepseek() -> ModelSpec:
    """DeepSeek-V3's tiny test config in bfloat16: its router biases are the float32 tensors of the model."""
    from reshard.layouts.families import discover, read_hf_config

    config = read_hf_config("examples/configs/deepseek-v3.json")
    family = discover(config)
    return family.spec(family.tiny_config(config)).model_copy(update={"dtype": "bfloat16"})


def as_jobs(named: list, drawn: list, workdir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """`refit_jobs.run_cases` cases (plans saved under `workdir`) and a label for each. `named`: (name, plan,
    binding, members, options with optional "repeat" / "refuse" / "store"); `drawn`: `random_cases` examples.
    "store": the refit group is a `comm.StoreComm` made over a FileStore of the case, not a torch group."""
    cases, labels = [], []
    for i, (name, plan, binding, members, options) in enumerate(named):
        options = dict(options)
        extra = {k: options.pop(k) for k in ("repeat", "refuse", "store") if k in options}
        path = plan.save(workdir / f"fixed{i}.npz")
        cases.append({"plan": str(path), "binding": binding.to_dict(), "group": members, "seed": i,
                      "options": options, **extra})
        labels.append(name)
    for i, (plan, binding, members, options, seed) in enumerate(drawn):
        options = dict(options)
        extra = {k: options.pop(k) for k in ("store",) if k in options}
        path = plan.save(workdir / f"random{i}.npz")
        cases.append({"plan": str(path), "binding": binding.to_dict(), "group": members, "seed": seed,
                      "options": options, **extra})
        labels.append(f"random {i}: {plan.src} -> {plan.dst} fanout={plan.fanout} {binding} group={members} "
                      f"{options}")
    return cases, labels


def failures(results: list, cases: list[dict[str, Any]], labels: list[str], world: int) -> list[str]:
    """Every member of every case must report ok (byte-identical to the local executor)."""
    out = []
    for i, (case, label) in enumerate(zip(cases, labels)):
        members = case["group"] if case["group"] is not None else list(range(world))
        for proc in members:
            r = results[proc][i]
            if r is None or not r["ok"]:
                out.append(f"{label} on world rank {proc}: {r and r['error']}")
    return out


def survivor_failures(results: list, survivors: list[int], undo: bool, within: float, logs: str) -> list[str]:
    """`refit_jobs.fail_mid_refit` results: every survivor raised ExecutionError within `within` seconds, said
    what became of its destinations, and (where it has any) kept them unchanged."""
    out = []
    for proc in survivors:
        r = results[proc]
        if r is None:
            out.append(f"survivor {proc} did not report:\n{logs[-3000:]}")
            continue
        said = "restored to their previous weights" if undo else "unchanged"
        if r["raised"] != "ExecutionError" or "refit failed" not in r["message"] or said not in r["message"]:
            out.append(f"survivor {proc} raised {r['raised']}: {r['message']!r}")
        if r["seconds"] >= within:
            out.append(f"survivor {proc} took {r['seconds']:.1f} s (limit {within:.1f} s)")
        if r["has_dst"] and not r["unchanged"]:
            out.append(f"survivor {proc}: destination tensors changed")
    return out


__all__ = ["as_jobs", "examples", "failures", "random_cases", "survivor_failures", "tiny_deepseek", "tiny_spec"]
