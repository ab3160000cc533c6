"""One vLLM TP rank's FP8 checks against real vLLM model code on CPU, for test_vllm_fp8.py; world_checks.py runs
`run_case` in each rank's process of the session's world. A case's report: per check, "ok" or what failed.

Ground truth: vLLM's own `load_weights` of an FP8 checkpoint quantized from the same bf16 weights by the
reference quantizer (`harness.fp8_reference`, written apart from the library's), followed by vLLM's
`process_weights_after_loading`. vLLM's CPU block-FP8 kernel needs AMX and an op the CUDA wheel lacks, and it
re-packs the weight for AMX; these checks build the model with the CPU kernel class standing in for vLLM's CUDA
block-FP8 kernel (`Fp8BlockScaledMMLinearKernel`: its post-load step `process_fp8_weight_block_strategy`, what
an NVIDIA GPU engine runs), so that the parameters compared are those a GPU engine keeps.

MoE cases compare the parameters before `process_weights_after_loading` ("processed": false): vLLM 0.33 finds
no FP8 MoE backend on CPU (its post-load step raises), and on GPUs the MoE backends convert experts to their
kernel format (`convert_to_fp8_moe_kernel_format`), so processed FP8 experts are a loader-install destination.

A case: {"name", "ckpt", "src", "ep", "processed"}.
"""
from __future__ import annotations

import contextlib
import os
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

import vllm_harness as harness  # noqa: E402
import reshard  # noqa: E402
from reshard.adapters.vllm.direct import bind_fp8, fp8_problems  # noqa: E402
from reshard.errors import ModelConfigError  # noqa: E402
from reshard.executors.fp8 import Fp8Executor  # noqa: E402
from reshard.executors.reference import allocate, shard  # noqa: E402
from reshard.layouts import parse_layout  # noqa: E402
from reshard.layouts.fp8 import FP8, Fp8Scheme  # noqa: E402
from reshard.planner.fp8 import compile_fp8  # noqa: E402
from harness.fp8_jobs import execute_fp8_local  # noqa: E402
from harness.fp8_reference import reference_checkpoint, same_bytes  # noqa: E402


@contextlib.contextmanager
def gpu_block_fp8_kernel():
    """vLLM's CPU block-FP8 kernel class, made to stand in for the CUDA one (see the module doc)."""
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel as K

    saved = {k: K.__dict__[k] for k in ("is_supported", "process_weights_after_loading")}
    K.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    K.process_weights_after_loading = Fp8BlockScaledMMLinearKernel.process_weights_after_loading
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(K, k, v)


def loaded(case: dict, world: int, tensors: dict[str, torch.Tensor]):
    """A vLLM model of the case's checkpoint (a fresh engine config: vLLM registers each model's layers by name
    in it), loaded with `tensors` by its own load_weights, then post-processed."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    cfg = harness.engine_config(case["ckpt"], world, ep=bool(case.get("ep")))
    with gpu_block_fp8_kernel():
        model = harness.build_model(cfg)
        model.load_weights(iter([(k, v.clone()) for k, v in tensors.items()]))
        if case.get("processed", True):
            process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
    return model


def differences(a, b) -> list[str]:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    out = [f"{n}: only in one model" for n in sorted(set(pa) ^ set(pb))]
    out += [f"{n}: {tuple(pa[n].shape)} {pa[n].dtype} differs" for n in sorted(set(pa) & set(pb))
            if not same_bytes(pa[n].data, pb[n].data)]
    return out


def bf16_weights(spec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=g) * 0.05).to(torch.bfloat16) for t in spec.tensors}


def run_case(case: dict, rank: int, world: int) -> dict[str, str]:
    report: dict[str, str] = {}

    def check(name, fn):
        try:
            with harness.attributed(case, name):
                fn()
            report[name] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per check
            report[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"

    spec = reshard.ModelSpec.from_hf_config(case["ckpt"])
    scheme = Fp8Scheme.from_hf_config(case["ckpt"])
    src = parse_layout(case["src"], spec)
    dst = reshard.VllmLayout(model=spec, tp=world, expert_parallel=bool(case.get("ep")))
    fp = compile_fp8(src, dst, scheme)
    quantized = {t.name for t in fp.full_dst.model.tensors if t.dtype == FP8}
    w = bf16_weights(spec, 11)
    truth = loaded(case, world, reference_checkpoint(w, quantized, scheme.block))
    engine = loaded(case, world, reference_checkpoint(bf16_weights(spec, 12), quantized, scheme.block))  # other weights

    def parameters_match_declared():
        problems = fp8_problems(engine, fp, rank)
        assert not problems, problems[:5]
        n8 = sum(p.dtype == torch.float8_e4m3fn for p in engine.parameters())
        assert n8 == sum(fp.full_dst.tensor_dtype(rank, n) == FP8 for n in fp.full_dst.rank_tensors(rank)) > 0

    def direct_install_matches_load_weights():
        tensors = bind_fp8(engine, fp, rank)
        Fp8Executor(fp, None, 0, shard(src, w), {rank: tensors}, inner="reference").refit()
        diff = differences(engine, truth)
        assert not diff, diff[:5]

    def loader_install_matches_load_weights():
        hf = compile_fp8(src, reshard.HfLayout(model=spec), scheme)
        out = allocate(hf.full_dst, 0.0, ranks=[0])
        execute_fp8_local(hf, shard(src, w), out)  # the FP8 checkpoint's tensors, by HF name
        assert any(n.endswith("weight_scale_inv") for n in out[0])
        model = loaded(case, world, out[0])
        diff = differences(model, truth)
        assert not diff, diff[:5]

    def sender_quantization_halves_the_wire():
        assert set(fp.where.values()) == {"sender"}, fp.why
        assert fp.wire_bytes < fp.baseline_bytes, (fp.wire_bytes, fp.baseline_bytes)  # embeddings stay bf16

    def other_block_size_refused():
        other = compile_fp8(src, dst, Fp8Scheme(block=(64, 64)))
        problems = fp8_problems(engine, other, rank)
        assert any("weight_scale_inv" in p and "64x64 blocks" in p for p in problems), problems[:3]
        try:
            Fp8Scheme(block=(64, 64)).check_engine(case["ckpt"])
        except ModelConfigError as e:
            assert "weight_block_size" in str(e)
        else:
            raise AssertionError("check_engine accepted another block size")

    def other_ignored_modules_refused():
        module = "model.layers.0.self_attn.o_proj"
        other = compile_fp8(src, dst, Fp8Scheme(ignored=(module,)))
        problems = fp8_problems(engine, other, rank)
        assert any(module in p and "bfloat16" in p for p in problems), problems[:3]

    check("parameters_match_declared", parameters_match_declared)
    check("direct_install_matches_load_weights", direct_install_matches_load_weights)
    check("loader_install_matches_load_weights", loader_install_matches_load_weights)
    check("sender_quantization_halves_the_wire", sender_quantization_halves_the_wire)
    check("other_block_size_refused", other_block_size_refused)
    check("other_ignored_modules_refused", other_ignored_modules_refused)
    return report

