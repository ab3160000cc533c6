"""One vLLM TP rank's checks against real vLLM model code on CPU, for test_vllm_install.py; world_checks.py runs
`run_case` in each rank's process of the session's world (WORLD_SIZE, RANK, MASTER_ADDR/PORT in the environment).
A case's report: per check, "ok" or what failed. vLLM's own `load_weights` of the HF checkpoint is the ground truth
throughout. A case: {"name", "ckpt", "ep", "src", "colocated_src"}.
"""
from __future__ import annotations

import os
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

import vllm_harness as harness  # noqa: E402
import reshard  # noqa: E402
from reshard.adapters.refit import RefitSpec  # noqa: E402
from reshard.adapters.vllm import LoaderInstaller, bind_direct, check_layout, derive_layout  # noqa: E402
from reshard.adapters.vllm.derive import declared_placements  # noqa: E402
from reshard.adapters.vllm.live import weights  # noqa: E402
from reshard.executors import ReferenceExecutor, shard  # noqa: E402
from reshard.layouts import Role  # noqa: E402

_SWAP = {Role.GATE, Role.UP, Role.EXPERT_GATE, Role.EXPERT_UP}


class GateUpSwapped(reshard.VllmLayout):
    """A declaration that is wrong the way a vLLM version storing [up; gate] would be: same shapes."""

    def placements(self, tensor, replica=None):
        out = super().placements(tensor, replica)
        if tensor.role not in _SWAP:
            return out
        swapped = []
        for p in out:
            per, row = p.lengths[0], p.phys_offset[-2]
            swapped.append(p._replace(phys_offset=p.phys_offset[:-2] + (per - row, 0)))
        return swapped


class LoopbackClient:
    """vLLM's weight-sync client protocol, served by this process's worker engine the way a worker's RPC
    handlers serve it (parse the dict, call the engine)."""

    def __init__(self, engine):
        self.engine = engine

    def init_weight_transfer_engine(self, init_info):
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self):
        self.engine.start_weight_update()

    def update_weights(self, update_info):
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version=None):
        self.engine.finish_weight_update()


def snapshot(model):
    return {n: p.detach().clone() for n, p in weights(model).items()}


def same_bytes(model, ref) -> list[str]:
    live = weights(model)
    bad = sorted(set(ref) ^ set(live))
    for n, r in ref.items():
        p = live.get(n)
        if p is not None and not torch.equal(p.detach().contiguous().view(torch.uint8),
                                             r.contiguous().view(torch.uint8)):
            bad.append(n)
    return bad


def poison(model) -> None:
    with torch.no_grad():
        for p in weights(model).values():
            p.fill_(float("nan"))


def run_case(case: dict, rank: int, world: int) -> dict[str, str]:
    from vllm.config import set_current_vllm_config

    results: dict[str, str] = {}

    def check(name, fn):
        try:
            with harness.attributed(case, name):
                problem = fn()
            results[name] = "ok" if not problem else f"FAIL: {problem}"
        except Exception:  # noqa: BLE001 - reported, the test fails on it
            results[name] = "FAIL: " + traceback.format_exc(limit=6)

    cfg = harness.engine_config(case["ckpt"], world, case["ep"])
    model = harness.build_model(cfg)
    hf = harness.load_checkpoint(case["ckpt"])
    spec = reshard.ModelSpec.from_hf_config(case["ckpt"])
    layout = reshard.VllmLayout(model=spec, tp=world, expert_parallel=case["ep"])
    src = reshard.parse_layout(case["src"], spec)
    src_tensors = shard(src, hf)

    # Ground truth: vLLM's own loaders on the HF checkpoint.
    poison(model)
    with set_current_vllm_config(cfg):
        model.load_weights(iter([(k, v.clone()) for k, v in hf.items()]))
    ref = snapshot(model)

    def derived_equals_declared():
        derived = derive_layout(model, spec, rank, None, cfg)
        declared = declared_placements(layout, rank, spec.tensors)
        if derived.problems:
            return list(derived.problems)
        if sorted(derived.placements) != sorted(declared):
            extra = sorted(set(derived.placements) - set(declared))[:3]
            missing = sorted(set(declared) - set(derived.placements))[:3]
            return f"derived but not declared {extra}; declared but not derived {missing}"
        live = {n: s for n, (s, _) in derived.tensors.items()}
        if live != layout.rank_tensors(rank):
            return f"live tensors {live} != declared {layout.rank_tensors(rank)}"
        if not derived.placements:
            return "nothing derived"
        return same_bytes(model, ref)  # the probe put the live weights back untouched

    def direct_install_matches_load_weights():
        poison(model)
        binding = bind_direct(model, layout, rank, None, cfg)
        plan = reshard.compile_plan(src, layout)
        ReferenceExecutor(plan, None, 0, src_tensors, {rank: binding.tensors}).refit()
        binding.finish()
        return same_bytes(model, ref)

    def loader_install_matches_load_weights():
        poison(model)
        plan = RefitSpec.of(spec, src, layout, install="loader").plan()
        installer = LoaderInstaller(model, rank, plan, cfg)
        ReferenceExecutor(plan, None, 0, src_tensors, {rank: installer.buffers}).refit()
        installer.load()  # the reload around it (post-load processing) needs kernels only the CPU build has
        return same_bytes(model, ref)

    def trainer_engine(dst, key, source=src, tensors=src_tensors, transport="inprocess", **fields):
        """The `reshard` backend picked by name from vLLM's factories, worker and trainer side."""
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                               WeightTransferTrainerFactory)

        from reshard.adapters.vllm.engine import register
        from reshard.adapters.vllm.trainer import ReshardTrainerInitInfo

        register()
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), cfg,
                                                           torch.device("cpu"), model)
        refit = RefitSpec.of(spec, source, dst, install="direct", transport=transport, options={"key": key},
                             verify_layers=list(range(spec.num_layers)), **fields)
        # every process drives its own worker engine (colocated: each is also a vLLM rank), as trainer rank 0
        info = ReshardTrainerInitInfo(refit=refit.to_dict(), rank=0)
        engines.append(engine)
        return WeightTransferTrainerFactory.trainer_init(info, client=LoopbackClient(engine), source=tensors)

    engines: list = []  # the worker engines made by trainer_engine, last one last

    def engine_direct_refit_matches_load_weights():
        poison(model)
        trainer = trainer_engine(layout, "direct")
        trainer.send_weights(version="v1")
        trainer.shutdown()
        return same_bytes(model, ref)

    def engine_staged_refit_flips_only_at_install():
        # RefitSpec(staging="device"): the transfer lands in a staged copy of this rank's shard on a thread of the
        # worker's own (the engine may generate meanwhile) and returns at once; the live weights change only at the
        # install (the flip), which waits for it
        poison(model)
        before = snapshot(model)
        trainer = trainer_engine(layout, "staged", staging="device")
        worker, info = engines[-1], {"version": "v1", "refit": ""}
        worker.start_weight_update()
        worker.update_weights({**info, "phase": "transfer"})
        early = [f"written before the flip: {n}" for n in same_bytes(model, before)]
        worker.update_weights({**info, "phase": "install"})
        worker.finish_weight_update()
        trainer.shutdown()
        return early + same_bytes(model, ref)

    def engine_colocated_refit_matches_load_weights():
        # every process is one trainer rank and one vLLM rank (vLLM's external_launcher); it holds only its own
        # Megatron shard, and reshard's torch.distributed executor moves the bytes between the processes over
        # vLLM's gloo world group
        colocated = reshard.parse_layout(case["colocated_src"].format(w=world), spec)
        mine = {rank: shard(colocated, hf, ranks=[rank])[rank]}
        poison(model)
        trainer = trainer_engine(layout, "colocated", colocated, mine, transport="colocated")
        trainer.send_weights(version="v1")
        trainer.shutdown()
        return same_bytes(model, ref)

    def engine_refuses_other_destination():
        before = snapshot(model)
        other = reshard.VllmLayout(model=spec, tp=world, expert_parallel=case["ep"], vocab_padding=256)
        try:
            trainer_engine(other, "other")
        except reshard.ExecutionError as e:  # the engine's LayoutMismatchError, as the trainer is told it
            if "LayoutMismatchError" not in str(e) or "the engine runs" not in str(e) or "vocab_padding" not in str(e):
                return f"unexpected error: {e}"
            return same_bytes(model, before)
        # the engine's workers agree on a refusal and only its last worker raises (adapters.vllm.session.agreed):
        # the others refuse quietly, holding no session
        if rank == world - 1 or engines[-1].steps.session is not None:
            return "the engine accepted a trainer's destination layout that differs from its own"
        return same_bytes(model, before)

    def wrong_shape_declaration_refused():
        before = snapshot(model)
        wrong = reshard.VllmLayout(model=spec, tp=world, expert_parallel=case["ep"], vocab_padding=40)
        try:
            bind_direct(model, wrong, rank, None, cfg)
        except reshard.LayoutMismatchError as e:
            name = "model.embed_tokens.weight"
            want = f"live {tuple(layout.rank_tensors(rank)[name])} bfloat16, declared " \
                   f"{tuple(wrong.rank_tensors(rank)[name])} bfloat16"
            if not any(p.startswith(name) and want in p for p in e.problems):
                return f"error does not name {name} with both shapes: {e.problems}"
            return same_bytes(model, before)
        return "a declaration with other shapes was accepted"

    def wrong_stacking_refused():
        before = snapshot(model)
        wrong = GateUpSwapped(model=spec, tp=world, expert_parallel=case["ep"])
        try:
            check_layout(model, wrong, rank, None, cfg)
        except reshard.LayoutMismatchError as e:
            if not any("gate_proj" in p and "vLLM's loaders put" in p for p in e.problems):
                return f"error does not name the gate projection: {e.problems[:3]}"
            return same_bytes(model, before)
        return "a declaration with [up; gate] stacking was accepted"

    def processed_model_refused():
        # vLLM's own post-load processing on CPU dispatches every linear to a CPU GEMM kernel. Which one depends on
        # the CPU: with AMX (small bf16 weights) the sgl path packs the weight with `convert_weight_packed` and
        # replaces it by an empty one; without, the fallback keeps it. The test harness decides which path runs
        # (tests/cpu_path: scripts/test runs this module on both); everything else is vLLM's own code.
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        from reshard.adapters.vllm.direct import relaid_problems

        out = []
        fresh = harness.engine_config(case["ckpt"], world, case["ep"])  # a model registers its layers there
        with set_current_vllm_config(fresh):
            processed = harness.build_model(fresh)
            processed.load_weights(iter([(k, v.clone()) for k, v in hf.items()]))
            process_weights_after_loading(processed, fresh.model_config, torch.device("cpu"))
        path = harness.cpu_path()
        if not any("qkv_proj" in p and "CPU GEMM" in p for p in relaid_problems(processed, weights(processed))):
            out.append(f"{path}: qkv_proj's CPU GEMM dispatch is not named")
        try:
            bind_direct(processed, layout, rank, None, fresh)
            out.append(f"{path}: a model whose linears were dispatched to CPU kernels was accepted")
        except reshard.LayoutMismatchError as e:  # AMX: empty weights (a structure error); else the kernel
            named = [p for p in e.problems if "qkv_proj" in p and ("CPU GEMM" in p or "live (0,)" in p)]
            if not named:
                out.append(f"{path}: the error does not name qkv_proj: {e.problems[:3]}")
        return out

    def processed_moe_refused():
        # vLLM's own MoE post-load processing on CPU: the CPU backend (its AMX or vector variant, chosen by the
        # CPU capability path the harness pins, as for the linears) pads the expert FFN dim, then prepacks (the
        # CUDA wheel lacks that last kernel; everything before it ran, the kernel object included)
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        from reshard.adapters.vllm.direct import relaid_problems

        out = []
        path = harness.cpu_path()
        fresh = harness.engine_config(case["ckpt"], world, case["ep"])  # a model registers its layers there
        with set_current_vllm_config(fresh):
            processed = harness.build_model(fresh)
            processed.load_weights(iter([(k, v.clone()) for k, v in hf.items()]))
            for module in processed.modules():
                if isinstance(module, RoutedExperts):
                    try:
                        module.quant_method.process_weights_after_loading(module)
                    except AttributeError as e:
                        if "prepack_moe_weight" not in str(e):
                            raise
        try:
            bind_direct(processed, layout, rank, None, fresh)
            out.append(f"{path}: a model whose experts the CPU MoE backend re-laid out was accepted")
        except reshard.LayoutMismatchError as e:  # padded shapes (TP2) or, same shapes (TP1), the backend
            if not any("w13_weight: live" in p or "w13_weight: MoE backend CPU" in p for p in e.problems):
                out.append(f"{path}: the re-laid out experts are not named: {e.problems[:3]}")
        problems = relaid_problems(processed, weights(processed))
        if not any("w13_weight" in p and "MoE backend CPU" in p for p in problems):
            out.append(f"{path}: the CPU MoE backend is not named: {problems[:3]}")
        return out

    check("derived_equals_declared", derived_equals_declared)
    check("direct_install_matches_load_weights", direct_install_matches_load_weights)
    check("loader_install_matches_load_weights", loader_install_matches_load_weights)
    check("engine_direct_refit_matches_load_weights", engine_direct_refit_matches_load_weights)
    check("engine_staged_refit_flips_only_at_install", engine_staged_refit_flips_only_at_install)
    check("engine_colocated_refit_matches_load_weights", engine_colocated_refit_matches_load_weights)
    check("engine_refuses_other_destination", engine_refuses_other_destination)
    check("wrong_shape_declaration_refused", wrong_shape_declaration_refused)
    check("wrong_stacking_refused", wrong_stacking_refused)
    check("processed_moe_refused" if spec.is_moe else "processed_model_refused",
          processed_moe_refused if spec.is_moe else processed_model_refused)
    return results

