"""The Megatron source adapter against real megatron-core GPT models on CPU, several gloo ranks per case.

One set of processes per case does everything on the live model, rank by rank:
  (a) the layout derived from the model equals the declared one; its parameters check clean against it; the
      source tensors are views of the live parameters (same data_ptr), and binding them (derive, check, bind)
      walks the model exactly as often as reading it once does; TransformerEngine names, taken from megatron's
      own checkpoint keys, derive the TE layout and check clean against it;
  (b) a refit Megatron -> HF layout moved over gloo send/recv (a stand-in until the torch.distributed
      executor lands) writes a checkpoint; this test process loads it into transformers' Qwen3 / Qwen3-MoE
      and compares its logits with the Megatron model's logits on the same tokens;
  (c) for TP2 cases, Megatron TP2 -> Megatron TP1 through reshard equals megatron-core's own TP1 weights
      from the same seed, byte for byte (every element holding model data).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import reshard
from reshard.adapters.megatron.forward import forward_logits
from reshard.testing.megatron_cpu import TinyGPT, build_model, init_parallel, run_ranks

pytestmark = pytest.mark.megatron

# fp32 end to end; megatron and transformers order their float operations differently, so the logits agree to
# rounding (measured max |diff| a few 1e-7 at logit scale ~1), not bit for bit.
LOGIT_ATOL = 2e-5
DENSE = TinyGPT()
MOE = TinyGPT(num_experts=4)


@dataclass(frozen=True)
class Case:
    tiny: TinyGPT
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    tp1_check: bool = False  # (c)
    negatives: bool = False  # mismatching specs, TP and dtypes must raise
    wrong: tuple[dict, str] = ({}, "")  # a declaration that must raise, and a line of its message
    bf16_wrapped: bool = False  # finally wrap the chunks in megatron's Float16Module (bf16) and bind again

    def layout(self, **changes: object) -> reshard.MegatronLayout:
        fields = dict(model=self.tiny.spec(), tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, world=self.world,
                      vpp=self.vpp or 1, first_stage_layers=self.tiny.first_stage_layers if self.pp > 1 else None,
                      vocab_divisor=64)
        return reshard.MegatronLayout(**{**fields, **changes})


CASES = {
    "dense_tp2": Case(DENSE, world=2, tp=2, tp1_check=True, negatives=True),
    "dense_tp2_g1": Case(replace(DENSE, num_query_groups=1), world=2, tp=2, tp1_check=True),  # query groups < TP
    "dense_pp2_vpp2_tied": Case(replace(DENSE, tied=True), world=2, pp=2, vpp=2, bf16_wrapped=True,
                                wrong=({"vpp": 1}, "vpp: the model has 2, the declared layout 1")),
    "dense_pp2_uneven": Case(replace(DENSE, num_layers=6, first_stage_layers=2), world=2, pp=2, wrong=(
        {"first_stage_layers": None}, "first_stage_layers: the model has 2, the declared layout None")),
    "moe_tp2": Case(MOE, world=2, tp=2, tp1_check=True, wrong=({"etp": 1}, "etp: the model has 2, the declared "
                                                                           "layout 1")),
    "moe_pp2": Case(MOE, world=2, pp=2, wrong=({"naming": "te"}, "naming: the model has local, the declared "
                                                                 "layout te")),
    "moe_ep2": Case(MOE, world=2, ep=2, etp=1, wrong=({"ep": 1}, "ep: the model has 2, the declared layout 1")),
    # Names and shapes agree under another rank order, but ranks would hold other experts: only the order says so.
    "moe_tp2_ep2": Case(MOE, world=4, tp=2, ep=2, etp=1, tp1_check=True, wrong=(
        {"rank_order": "tp-cp-dp-ep-pp"}, "rank_order: the model has tp-cp-ep-dp-pp, the declared layout "
                                          "tp-cp-dp-ep-pp")),
}


# --- TransformerEngine names from megatron's own checkpoint keys --------------------------------------------

def _flatten(tree, out=None):
    out = {} if out is None else out
    for key, value in tree.items():
        if isinstance(value, dict):
            _flatten(value, out)
        else:
            out[key] = value
    return out


def te_names(chunks) -> dict[str, str]:
    """Local-spec physical name -> TE-spec name. The local spec checkpoints every tensor under the key the TE
    spec uses (`sharded_state_dict_keys_map`: input_layernorm -> linear_qkv.layer_norm_weight, pre_mlp_layernorm
    -> linear_fc1.layer_norm_weight), with the layer index dropped. Two names come from TE's source instead:
    a MoE layer's norm stays `pre_mlp_layernorm.weight` (the TE MoE spec keeps a separate TENorm), and
    TEGroupedMLP registers expert j as `linear_fc1.weight{j}` (the checkpoint key `experts.experts.linear_fc1`
    is shared by both specs)."""
    out = {}
    for c, chunk in enumerate(chunks):
        prefix = f"model{c}." if len(chunks) > 1 else ""
        params = dict(chunk.named_parameters())
        moe_layers = {m[1] for n in params if (m := re.match(r"decoder\.layers\.(\d+)\.mlp\.router\.", n))}
        for name, sharded in _flatten(chunk.sharded_state_dict()).items():
            if name not in params:
                continue  # _extra_state and the like
            layer = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
            if layer is None:  # embedding, output layer, final norm: one name in both specs
                out[prefix + name] = prefix + name
                continue
            i, suffix = layer.groups()
            key = re.sub(r"^decoder\.layers\.(\d+\.)?", "", sharded.key)
            expert = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", suffix)
            if expert:
                assert key == f"mlp.experts.experts.{expert[2]}.weight", (name, sharded.key)
                key = f"mlp.experts.{expert[2]}.weight{expert[1]}"
            elif suffix == "pre_mlp_layernorm.weight" and i in moe_layers:
                assert key == "mlp.linear_fc1.layer_norm_weight", (name, sharded.key)
                key = "pre_mlp_layernorm.weight"
            out[prefix + name] = f"{prefix}decoder.layers.{i}.{key}"
    return out


# --- the per-rank scenario -----------------------------------------------------------------------------------

def _worker(name: str, outdir: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from dataclasses import replace

    from reshard.adapters.megatron import (derive_layout, layout_problems, rank_problems, read_model,
                                           source_tensors, spec_from_megatron, verify)
    from reshard.executors import allocate
    from reshard.testing.checks import data_mask
    from reshard.executors.binding import Binding
    from reshard.executors.collective.executor import execute_collective

    case = CASES[name]
    spec = case.tiny.spec()
    rank = dist.get_rank()
    result: dict[str, object] = {"rank": rank}
    init_parallel(case.tp, case.pp, case.ep, case.etp, case.vpp)
    chunks = build_model(case.tiny)
    declared = case.layout()

    # (a) read once, derive, check, bind
    facts = read_model(chunks)
    assert derive_layout(chunks, spec, like=declared) == declared, derive_layout(chunks, spec, like=declared)
    free = derive_layout(facts, spec)  # without a preference: same placement, maybe another vocab divisor
    assert layout_problems(free, declared) == [], layout_problems(free, declared)
    result["derived"] = str(free)
    assert verify(chunks, declared) == declared
    src = source_tensors(chunks, declared)
    live = dict(facts.parameters)
    assert set(src) == set(declared.rank_tensors(rank)) == set(live)
    assert all(src[n].data_ptr() == live[n].data_ptr() for n in src), "source tensors must be views"
    result["zero_copy_tensors"] = len(src)
    walks = _walks(chunks, lambda: source_tensors(chunks, declared))  # derives, checks and binds
    assert walks == _walks(chunks, lambda: read_model(chunks)), walks
    assert all(walks[(c, "named_parameters")] == 1 for c in range(len(chunks))), walks
    assert spec_from_megatron(chunks[0], vocab_size=spec.vocab_size) == spec
    assert spec_from_megatron(facts, vocab_size=spec.vocab_size) == spec

    te = case.layout(naming="te")
    names = te_names(chunks)
    renamed = {names[n]: t for n, t in live.items()}
    te_facts = replace(facts, parameters=renamed)  # the same model under TE names: checked from facts alone
    assert derive_layout(te_facts, spec, like=te) == te, derive_layout(te_facts, spec, like=te)
    assert verify(te_facts, te) == te
    assert rank_problems(te, rank, renamed) == [], rank_problems(te, rank, renamed)
    assert rank_problems(te, rank, live), "local names must not pass as TE names"
    result["te_names"] = sorted(set(renamed) - set(live))[:6]

    if case.negatives:
        _negative_declarations(chunks, case)
    changes, line = case.wrong
    if changes:
        with pytest.raises(reshard.LayoutMismatchError) as err:
            source_tensors(chunks, case.layout(**changes))
        assert line in str(err.value), str(err.value)

    torch.manual_seed(7)
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    logits = forward_logits(chunks, tokens)

    # (b) Megatron -> HF over send/recv; rank 0 hosts the HF destination
    hf = reshard.HfLayout(model=spec)
    plan = reshard.compile(declared, hf)
    dst = allocate(hf, fill=float("nan"), ranks=[0]) if rank == 0 else {}
    world = dist.get_world_size()
    stats = execute_collective(plan, Binding(tuple(range(world)), (0,)), {rank: src}, dst, timeout=120.0)
    result["sent_bytes"] = sum(stats.bytes_sent.values())
    if rank == 0:
        Path(outdir, "hf").mkdir()
        save_file(dst[0], str(Path(outdir, "hf", "model.safetensors")), metadata={"format": "pt"})
        save_file({"logits": logits, "tokens": tokens}, str(Path(outdir, "megatron.safetensors")))
        result["plan"] = plan.digest[:12]
    assert all(src[n].data_ptr() == live[n].data_ptr() for n in src)

    # (c) Megatron TP2 -> TP1 through reshard vs megatron-core's own TP1 model from the same seed
    if case.tp1_check:
        tp1 = case.layout(tp=1, etp=1)
        plan1 = reshard.compile(declared, tp1)
        got = allocate(tp1, fill=float("nan"), ranks=[rank])
        execute_collective(plan1, Binding(tuple(range(world)), tuple(range(world))), {rank: src}, got,
                            timeout=120.0)
        init_parallel(1, case.pp, case.ep, 1, case.vpp)
        chunks1 = build_model(case.tiny)
        assert derive_layout(chunks1, spec, like=tp1) == tp1
        ref = source_tensors(chunks1, tp1)
        masks = data_mask(tp1)
        compared, differ = 0, []
        for n, t in ref.items():
            data = masks[(rank, n)].bool()
            if not torch.equal(_bits(got[rank][n])[data], _bits(t)[data]):
                differ.append(n)
            assert torch.isnan(got[rank][n][~data]).all(), f"{n}: padding written"
            compared += int(data.sum())
        assert not differ, f"TP2 -> TP1 differs from megatron-core's TP1 weights in {differ}"
        result["tp1_elements_equal"] = compared
    elif case.bf16_wrapped:
        _bf16_wrapped(chunks, case)
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))


def _walks(chunks, call) -> dict[tuple[int, str], int]:
    """How often `call()` walks each chunk's parameters and modules (instance attributes shadow the methods)."""
    counts: dict[tuple[int, str], int] = {}

    def counting(c: int, method: str):
        original = getattr(chunks[c], method)

        def counted(*args, **kwargs):
            counts[(c, method)] = counts.get((c, method), 0) + 1
            return original(*args, **kwargs)
        return counted

    methods = ("named_parameters", "named_modules")
    for c, chunk in enumerate(chunks):
        for method in methods:
            setattr(chunk, method, counting(c, method))
    try:
        call()
    finally:
        for chunk in chunks:
            for method in methods:
                delattr(chunk, method)
    return counts


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor, so that equality is byte equality."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _negative_declarations(chunks, case: Case) -> None:
    """Declarations that do not match the live model raise before anything moves, naming what differs."""
    from reshard.adapters.megatron import source_tensors, verify

    wider = replace(case.tiny, ffn_hidden_size=128).spec()
    with pytest.raises(reshard.LayoutMismatchError) as err:
        source_tensors(chunks, reshard.MegatronLayout(model=wider, tp=case.tp, world=case.world, vocab_divisor=64))
    msg = str(err.value)
    assert "decoder.layers.0.mlp.linear_fc1.weight has shape (96, 64) in the model, (128, 64) in the layout" in msg
    assert "ffn_hidden_size: the model has 96, the spec qwen3 declares 128" in msg
    with pytest.raises(reshard.LayoutMismatchError) as err:
        verify(chunks, case.layout(tp=1))
    msg = str(err.value)
    assert "tp: the model has 2, the declared layout 1" in msg
    assert "self_attention.linear_qkv.weight has shape (128, 64) in the model, (256, 64) in the layout" in msg
    with pytest.raises(reshard.LayoutMismatchError, match="float32 in the model, torch.bfloat16 in the layout"):
        verify(chunks, reshard.MegatronLayout(model=case.tiny.spec("bfloat16"), tp=2, vocab_divisor=64))
    cast = source_tensors(chunks, reshard.MegatronLayout(model=case.tiny.spec("bfloat16"), tp=2, vocab_divisor=64),
                          cast=True)
    assert all(t.dtype == torch.bfloat16 for t in cast.values())  # a documented copy


def _bf16_wrapped(chunks, case: Case) -> None:
    """A mixed-precision trainer's model: chunks inside Float16Module, parameters in bf16 (converted in place).
    Binding unwraps them and still hands out views."""
    import copy

    from megatron.core.transformer.module import Float16Module

    from reshard.adapters.megatron import read_model, source_tensors

    config = copy.copy(chunks[0].config)
    config.bf16 = True
    wrapped = [Float16Module(config, chunk) for chunk in chunks]
    tensors = source_tensors(wrapped, case.layout(model=case.tiny.spec("bfloat16")))
    live = read_model(chunks).parameters
    assert all(t.dtype == torch.bfloat16 and t.data_ptr() == live[n].data_ptr() for n, t in tensors.items())


# --- the test ------------------------------------------------------------------------------------------------

def _hf_logits(tiny: TinyGPT, directory: Path, tokens: torch.Tensor):
    from transformers import AutoModelForCausalLM

    tiny.hf_config().save_pretrained(directory)
    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    with torch.no_grad():
        return model, model(tokens).logits


def _swap_control(model, tiny: TinyGPT) -> None:
    """A wrong refit the comparison must catch: swap experts 0 and 1 (MoE) or gate and up (dense) in layer 0."""
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        if tiny.num_experts:
            w = mlp.experts.gate_up_proj
            w[[0, 1]] = w[[1, 0]].clone()
        else:
            gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
            tmp = gate.clone()
            gate.copy_(up)
            up.copy_(tmp)


@pytest.mark.parametrize("name", list(CASES))
def test_refit_from_live_megatron(name: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    case = CASES[name]
    run_ranks(case.world, _worker, name, str(tmp_path), timeout=300, errdir=str(tmp_path))
    results = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(case.world)]
    assert all(r["zero_copy_tensors"] > 0 for r in results)
    if case.tp1_check:
        assert all(r["tp1_elements_equal"] > 0 for r in results)

    meg = load_file(str(tmp_path / "megatron.safetensors"))
    V = case.tiny.vocab_size
    model, hf_logits = _hf_logits(case.tiny, tmp_path / "hf", meg["tokens"])
    diff = (hf_logits - meg["logits"][..., :V]).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{name}: HF logits differ from Megatron's by {diff:.2e}"
    _swap_control(model, case.tiny)
    with torch.no_grad():
        wrong = (model(meg["tokens"]).logits - meg["logits"][..., :V]).abs().max().item()
    assert wrong > 100 * LOGIT_ATOL, f"{name}: a swapped layer-0 MLP changed the logits by only {wrong:.2e}"
    print(f"{name}: {results[0]['derived']}; max|logit diff| {diff:.2e} (control {wrong:.2e})")
