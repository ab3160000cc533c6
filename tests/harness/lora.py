"""Ground truth for LoRA refits, written independently of reshard's layouts and cuts: random adapter weights, the
same adapter saved by the `peft` library itself, and a reference merge.

Canonical adapter tensors (reshard.layouts.lora) are the trainer's: one A per fused layer (qkv_proj, gate_up_proj).
`save_with_peft` maps them onto PEFT's own modules by hand: q_proj, k_proj and v_proj each get the fused A.
"""
from __future__ import annotations

from pathlib import Path

import torch

PEFT_OF = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj"}  # PEFT module -> the canonical module holding its A


def adapter_weights(spec, seed: int, scale: float = 0.5, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random canonical adapter weights (B non-zero: an adapter that changes the model's output)."""
    g = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=g) * scale).to(dtype) for t in spec.tensors}


def _canonical_name(peft_param: str) -> str:
    """`base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight` -> the canonical name of its
    values (`model.layers.0.self_attn.qkv_proj.lora_A.weight`)."""
    name = peft_param.removeprefix("base_model.model.").replace(".default.", ".")
    parts = name.split(".")
    module = parts[-3]
    if parts[-2] == "lora_A" and module in PEFT_OF:
        parts[-3] = PEFT_OF[module]
    return ".".join(parts)


def save_with_peft(checkpoint: str | Path, weights: dict[str, torch.Tensor], rank: int, alpha: float,
                   modules: list[str], out: str | Path) -> Path:
    """The adapter saved by `peft` itself: get_peft_model on the transformers model of `checkpoint`, its LoRA
    parameters set from `weights`, save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(model, config)
    seen = 0
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(weights[_canonical_name(name)])
                seen += 1
    if not seen:
        raise RuntimeError("peft made no LoRA parameters")
    peft_model.save_pretrained(str(out))
    return Path(out)


def reference_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float, rank: int) -> torch.Tensor:
    """W + (alpha / r) B A in float32, cast once to W's dtype: the merge every merged refit must equal."""
    delta = b.to(torch.float32) @ a.to(torch.float32)
    return (w.to(torch.float32) + delta * (alpha / rank)).to(w.dtype)


def base_weights(spec, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random whole base-model weights under their HF names."""
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g).to(dtype) for t in spec.tensors}


def merge_job(rank: int, world: int, args: dict) -> dict:
    """On a world of `tp` processes (reshard.testing.world): process p plays Megatron-Bridge adapter rank p, process 0 also
    the rank that holds the whole adapter and the base weights; the adapter travels over gloo (the distributed
    executor), process 0 merges it and saves the merged weights to `args["out"]/step-<k>.safetensors`, once per
    adapter seed in `args["seeds"]` (each merge starts from the same base)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    import reshard
    from reshard.adapters.lora import merge
    from reshard.executors import make_executor, shard
    from reshard.executors.binding import Binding
    from reshard.executors.reference import allocate
    from reshard.layouts.lora import lora_spec
    from reshard.testing.megatron_cpu import TinyGPT

    base = TinyGPT(**args["tiny"]).spec("bfloat16")
    spec = lora_spec(base, args["rank"], args["alpha"])
    src_layout, dst_layout = reshard.MegatronLayout(model=spec, tp=world), reshard.HfLayout(model=spec)
    plan = reshard.compile(src_layout, dst_layout)
    mine = {rank: shard(src_layout, adapter_weights(spec, args["seeds"][0], dtype=torch.bfloat16), ranks=[rank])[rank]}
    dst = allocate(dst_layout, ranks=[0]) if rank == 0 else {}
    executor = make_executor("collective", plan, Binding(tuple(range(world)), (0,)), rank, mine, dst,
                             group=dist.group.WORLD, timeout=60.0)
    weights = base_weights(base, args["base_seed"]) if rank == 0 else {}
    out = {}
    for k, seed in enumerate(args["seeds"]):
        if k:  # the trainer's step: new adapter values in the same tensors
            new = shard(src_layout, adapter_weights(spec, seed, dtype=torch.bfloat16), ranks=[rank])[rank]
            for name, t in mine[rank].items():
                t.copy_(new[name])
        executor.refit()
        if rank == 0:
            merged = {name: torch.empty_like(weights[name]) for name in weights}
            names = merge(spec, weights, dst[0], merged)
            save_file({n: merged[n] for n in names}, str(Path(args["out"]) / f"step-{k}.safetensors"))
            out[f"step-{k}"] = len(names)
    executor.close()
    return out


def attach_bridge_adapters(chunks: list, rank: int, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
                           ) -> None:
    """Give every targeted linear layer of a live megatron-core GPTModel an `adapter` made of megatron-core's own
    parallel linears, as Megatron-Bridge's ParallelLinearAdapter makes it: a column-parallel base gets
    linear_in = ColumnParallelLinear(in, r, gather_output=True) and linear_out = ColumnParallelLinear(r, out); a
    row-parallel one linear_in = RowParallelLinear(in, r, input_is_parallel=True) and linear_out =
    ColumnParallelLinear(r, out, gather_output=True). `in` / `out` are the base layer's global sizes."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    init = torch.nn.init.zeros_
    for chunk in chunks:
        for name, module in list(chunk.named_modules()):
            target = name.rsplit(".", 1)[-1]
            if target not in targets:
                continue
            # a routed expert's linear (SequentialMLP's local_experts.{j}): its adapter is cut over expert TP
            kw = dict(config=module.config, init_method=init, bias=False, is_expert=module.is_expert)
            adapter = torch.nn.Module()
            if target in ("linear_qkv", "linear_fc1"):  # column-parallel base
                adapter.linear_in = ColumnParallelLinear(module.input_size, rank, gather_output=True, **kw)
                adapter.linear_out = ColumnParallelLinear(rank, module.output_size, gather_output=False, **kw)
            else:
                adapter.linear_in = RowParallelLinear(module.input_size, rank, input_is_parallel=True,
                                                      skip_bias_add=True, **kw)
                adapter.linear_out = ColumnParallelLinear(rank, module.output_size, gather_output=True, **kw)
            module.adapter = adapter


TARGET_CODE = {"linear_qkv": 0, "linear_proj": 1, "linear_fc1": 2, "linear_fc2": 3}


def global_value(layer: int, target: str, which: str, row: int, col: int) -> float:
    """The value an adapter weight holds at (row, col) of its global tensor in megatron-core's coordinates: distinct
    for every tensor and element, exact in float32. Shards are filled from megatron-core's own sharded-state
    offsets, so what a rank holds is decided by megatron-core, not by reshard's layouts."""
    k = 8 * layer + 2 * TARGET_CODE[target] + (which == "out")
    return float(k * 40000 + row * 128 + col)


def bridge_refit_job(tp: int, out: str, rank: int, ckpt: str | None = None) -> None:
    """On each gloo rank (megatron_cpu.run_ranks): a TinyGPT GPTModel at TP `tp` with Megatron-Bridge-shaped
    adapters of rank `rank`, each shard filled by `global_value` at megatron-core's sharded-state offsets. Writes
    per adapter parameter its local shape and megatron-core's answer (global shape and offset) to
    `out/rank<r>.json`, then refits the adapter from views of the live parameters (`source_tensors`) over gloo into
    a PEFT layout on rank 0, which saves it to `out/peft.safetensors`. With `ckpt` (an existing empty directory),
    first saves the model with its adapters there as Megatron-Bridge does (`save_bridge_checkpoint`)."""
    import json

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import reshard
    from reshard.layouts.lora import lora_spec

    from reshard.testing.megatron_cpu import TinyGPT, build_model, init_parallel

    init_parallel(tp=tp)
    tiny = TinyGPT(num_layers=2)
    chunks = build_model(tiny)
    attach_bridge_adapters(chunks, rank)
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    report = {}
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not name.endswith(("adapter.linear_in", "adapter.linear_out")):
                continue
            sharded = module.sharded_state_dict(prefix=name + ".", metadata=metadata)[name + ".weight"]
            parts = name.split(".")
            layer, target, which = int(parts[parts.index("layers") + 1]), parts[-3], parts[-1].split("_")[1]
            (o0, o1), (n0, n1) = sharded.global_offset, module.weight.shape
            with torch.no_grad():
                for a in range(n0):
                    for b in range(n1):
                        module.weight[a, b] = global_value(layer, target, which, o0 + a, o1 + b)
            report[name + ".weight"] = {"local": list(module.weight.shape), "global": list(sharded.global_shape),
                                        "offset": list(sharded.global_offset)}
    if ckpt is not None:
        save_bridge_checkpoint(chunks, ckpt)
    names = [n for chunk in chunks for n, _ in chunk.named_parameters() if ".adapter." in n]
    me = dist.get_rank()
    Path(out, f"rank{me}.json").write_text(json.dumps({"shards": report, "parameters": names}))
    refit_into_peft(chunks, reshard.MegatronLayout(model=lora_spec(tiny.spec(), rank, 16), tp=tp), out)


def save_bridge_checkpoint(chunks: list, path: str) -> None:
    """On every gloo rank: megatron-core's dist_checkpointing.save (torch_dist) of a live GPTModel (one chunk, PP=1)
    with `attach_bridge_adapters` adapters, keyed as Megatron-Bridge's AdapterWrapper keys them: the base weights
    under their own keys and each adapter linear's own sharded state (megatron-core's ColumnParallelLinear /
    RowParallelLinear cuts) under `<module>.adapter.linear_{in,out}.weight`, stacked on the global layer axis as
    megatron-core's TransformerBlock stacks a layer's tensors, linear_fc1's B through megatron-core's
    apply_swiglu_sharded_factory as Bridge's ParallelLinearAdapter.sharded_state_dict does (the checkpoint then
    holds [gate; up] whatever the TP that saved it). (The base linear's own sharded state would
    declare its adapter child replicated: that entry is replaced.)"""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    filesystem_async._results_queue = queue.Queue()  # as megatron_ckpt.save_job: a synchronous save in a daemon
    torch.cuda.synchronize = lambda *a, **k: None
    (chunk,) = chunks
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    state = {k: v for k, v in chunk.sharded_state_dict(metadata=metadata).items() if ".adapter." not in k}
    layers = chunk.config.num_layers
    for name, module in chunk.named_modules():
        if not name.endswith(("adapter.linear_in", "adapter.linear_out")):
            continue
        layer, sub = name.removeprefix("decoder.layers.").split(".", 1)
        prefix, offsets = f"decoder.layers.{sub}.", ((0, int(layer), layers),)
        own = module.sharded_state_dict(prefix=prefix, metadata=metadata, sharded_offsets=offsets)
        if sub.endswith("linear_fc1.adapter.linear_out"):  # gate and up rows each at its place in [gate; up]
            own[prefix + "weight"] = apply_swiglu_sharded_factory(own[prefix + "weight"], offsets)
        state.update({f"{name}.{k.removeprefix(prefix)}": v for k, v in own.items()})  # keyed per layer, as the live
    dist_checkpointing.save({"model": state}, path)


def refit_into_peft(chunks: list, layout, out: str) -> None:
    """On every gloo rank: the adapter of the live model `chunks` (views of its parameters, in `layout`) refit into
    a PEFT layout on rank 0 over torch.distributed, which saves it to `out/peft.safetensors`."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    import reshard
    from reshard.adapters.megatron import source_tensors
    from reshard.executors import make_executor
    from reshard.executors.binding import Binding
    from reshard.executors.reference import allocate
    from reshard.layouts.lora import PeftLayout

    me, peft = dist.get_rank(), PeftLayout(model=layout.model)
    dst = {0: allocate(peft)[0]} if me == 0 else {}
    executor = make_executor("collective", reshard.compile(layout, peft),
                             Binding(tuple(range(dist.get_world_size())), (0,)), me,
                             {me: source_tensors(chunks, layout)}, dst, group=dist.group.WORLD, timeout=60.0)
    executor.refit()
    executor.close()
    if me == 0:
        save_file(dst[0], str(Path(out) / "peft.safetensors"))


class _SlotTrainer:
    """One trainer rank of the server tests of in-slot refits (megatron_cpu.run_ranks, world = the trainer's TP): the
    adapter of `job["checkpoint"]` at Megatron-Bridge TP = world, sessions into the slot of the served adapter."""

    def __init__(self, job: dict) -> None:
        import torch.distributed as dist

        from reshard.adapters.server import VllmServer
        from reshard.layouts import MegatronLayout, ModelSpec
        from reshard.layouts.lora import VllmLoraLayout, lora_spec

        self.job, self.rank, self.world = job, dist.get_rank(), dist.get_world_size()
        self.spec = lora_spec(ModelSpec.from_hf_config(job["checkpoint"]), job["rank"], job["alpha"])
        self.src = MegatronLayout(model=self.spec, tp=self.world)
        self.dst = VllmLoraLayout(model=self.spec, tp=job["server_tp"], max_lora_rank=job["max_lora_rank"])
        self.server = VllmServer(job["url"]) if self.rank == 0 else None

    def tensors(self, seed: int) -> dict:
        from reshard.executors import shard

        return shard(self.src, adapter_weights(self.spec, seed), ranks=[self.rank])[self.rank]

    def session(self, transport: str, lora_id: int, tensors: dict, api: bool = False, **options):
        """api: through the weight-transfer routes instead of the worker extension."""
        import torch.distributed as dist

        from reshard.adapters.refit import RefitSpec
        from reshard.adapters.server import ExtensionClient
        from reshard.adapters.trainer import TrainerSession

        refit = RefitSpec.of(self.spec, self.src, self.dst, install="lora_slot", lora_id=lora_id,
                             transport=transport, options=options)
        engine = self.server if api else ExtensionClient(self.server) if self.server else None
        return TrainerSession(refit, self.rank, tensors, engines=[engine] if engine else [],
                              trainer_group=dist.group.WORLD, timeout=120.0)

    def tokens(self) -> list:
        self.server.call("POST", "/reset_prefix_cache")
        return self.server.greedy(self.job["prompts"], max_tokens=8, model=self.job["name"])

    def report(self, run) -> None:
        """Run `run(out)`; rank 0 (and any rank that raised) writes `out`."""
        import json
        import traceback

        out: dict = {}
        try:
            run(out)
        except Exception:  # noqa: BLE001 - reported to the test
            out["exception"] = traceback.format_exc()
        if self.rank == 0 or "exception" in out:
            path = Path(self.job["out"])
            path = path if self.rank == 0 else path.with_suffix(f".rank{self.rank}.json")
            path.write_text(json.dumps(out))


def _init_error(session) -> str | None:
    from reshard.errors import ExecutionError

    try:
        session.init()
        return None
    except ExecutionError as e:
        return str(e)
    finally:
        session.close()


def slot_refit_job(job: dict) -> None:
    """Refit the slot of the adapter a running server serves as `job["name"]` (id `job["lora_id"]`) once per
    transport in `job["transports"]`, each time with the adapter values of seed `job["seeds"][k]`, through the
    reshard worker extension (ExtensionClient); rank 0 records the greedy tokens by that name after each. Then: a
    refit through the weight-transfer routes instead (refused at init), and one naming an adapter id the server
    does not have (refused), with the tokens after them."""
    me = _SlotTrainer(job)

    def run(out: dict) -> None:
        out["refits"] = []
        for transport, seed in zip(job["transports"], job["seeds"]):
            session = me.session(transport, job["lora_id"], me.tensors(seed))
            try:
                session.init()
                result = session.refit(f"{transport}-{seed}")
            finally:
                session.close()
            if me.server is not None:
                out["refits"].append({"transport": transport, "seconds": result.seconds, "tokens": me.tokens()})
        out["through_api"] = _init_error(me.session("collective", job["lora_id"], me.tensors(0), api=True))
        out["missing_slot"] = _init_error(me.session("collective", 99, me.tensors(0)))
        if me.server is not None:
            out["after_refused"] = me.tokens()

    me.report(run)


def slot_fault_job(job: dict) -> None:
    """The last trainer rank dies as an in-slot refit over `job["fault"]` begins (run_ranks with wait_all); rank 0
    records the refit's error, how long it took, and the tokens by the adapter's name after it."""
    import os
    import time

    from reshard.errors import ExecutionError

    me = _SlotTrainer(job)

    def run(out: dict) -> None:
        session = me.session(job["fault"], job["lora_id"], me.tensors(0), timeout=job["fault_timeout"])
        session.init()
        if me.rank == me.world - 1:
            os._exit(17)
        start = time.monotonic()
        try:
            session.refit("fault")
            out["error"] = None
        except ExecutionError as e:
            out["error"] = str(e)
        finally:
            session.close()
        out["seconds"] = time.monotonic() - start
        if me.server is not None:
            out["after"] = me.tokens()

    me.report(run)
