"""One EP rank of an EPLB engine built from real vLLM code on CPU (gloo); launched by test_vllm_eplb.py, one process
per EP rank. Writes rank{r}.json: per check, "ok" or what failed, and the placements' digests.

vLLM's CPU build cannot serve with EPLB, so no engine rebalances here by itself; everything EPLB does is run by
hand with vLLM's own code, as `EplbState.add_model` and `EplbState.rearrange` run it: the model built with
`enable_eplb` and redundant experts, weights loaded by its own `load_weights` (which writes the initial placement),
the EPLB maps made by `compute_logical_maps` and registered with `model.set_eplb_state`, new placements computed by
`DefaultEplbPolicy.rebalance_experts` on random expert loads, the weights moved between the EP ranks by
`rearrange_expert_weights_inplace` (its gloo communicator) and the maps committed by `_commit_eplb_maps`.

Ground truth for weights W after placements p0 (initial), p1, ..., pk: a second engine that loads W with vLLM's
`load_weights` and goes through the same rebalances. The live engine is refit through the `reshard` weight-transfer
engine (vLLM's factories, in-process transport), which reads the placement from the engine's EPLB state. Each EP
rank's process drives its own worker as vLLM's engine client would the engine (`EngineClient`: a call raises on
every driver if any worker raised), so each rank's trainer sees what a trainer driving the whole engine sees --
and follows a rebalanced placement by itself (adapters.placement_follow).

usage: eplb_checks.py OUT_DIR CKPT_OLD CKPT_NEW CKPT_NEWER
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

import vllm_harness as harness  # noqa: E402
import reshard  # noqa: E402
from rank_checks import LoopbackClient, poison, same_bytes, snapshot  # noqa: E402
from reshard.adapters.refit import RefitSpec  # noqa: E402
from reshard.adapters.vllm import bind_direct  # noqa: E402
from reshard.adapters.vllm.experts import live_placement  # noqa: E402
from reshard.executors import ReferenceExecutor, shard  # noqa: E402

REDUNDANT = 4  # 8 experts in 12 slots, 6 per EP rank
SOURCE = "megatron:tp=2,ep=2,etp=1"


class NoStream:
    """What the gloo EPLB communicator waits on before its sends: on CPU every copy has finished when it returns,
    and torch's CUDA wheel raises asking for the current stream without a GPU."""

    def synchronize(self) -> None:
        pass


torch.accelerator.current_stream = lambda device=None: NoStream()


class EngineClient(LoopbackClient):
    """vLLM's weight-sync client of the whole engine, seen from one EP rank's process: the call runs on this rank's
    worker, the ranks exchange what their workers raised, and every rank raises all of it (vLLM's executor reads
    every worker's answer and the engine raises if any failed; `adapters.vllm.session.agreed` has only the last worker
    raise, the others agree quietly)."""

    BYTES = 4096

    def __init__(self, engine, group):
        super().__init__(engine)
        self.group = group

    def _all(self, method, *args):
        import torch.distributed as dist

        error = None
        try:
            getattr(super(), method)(*args)
        except Exception as e:  # noqa: BLE001 - told to every rank below
            error = f"{type(e).__name__}: {e}"
        mine = torch.zeros(self.BYTES, dtype=torch.uint8)
        if error:
            data = error.encode()[:self.BYTES - 1]
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        got = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(got, mine, group=self.group)
        said = [bytes(t[t.nonzero().flatten()].tolist()).decode(errors="replace") for t in got if bool(t.any())]
        if said:
            raise reshard.ExecutionError("; ".join(said))

    def init_weight_transfer_engine(self, init_info):
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self._all("start_weight_update")

    def update_weights(self, update_info):
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self._all("finish_weight_update", weight_version)


def eplb_config(ckpt: str, world: int):
    """The engine's config with EPLB on and REDUNDANT redundant experts. vLLM's ParallelConfig refuses EPLB on a
    CPU platform when it validates, so the two fields are set after (what `--enable-eplb
    --eplb-config.num_redundant_experts N` sets on a GPU engine); the model and the EPLB code run on CPU alike."""
    cfg = harness.engine_config(ckpt, world, ep=True)
    cfg.parallel_config.enable_eplb = True
    cfg.parallel_config.eplb_config.num_redundant_experts = REDUNDANT
    return cfg


class Eplb:
    """One model's EPLB state, made and moved by vLLM's code (the module docstring says which)."""

    def __init__(self, model, num_logical: int) -> None:
        from vllm.distributed.eplb.eplb_communicator import TorchDistGlooStagedEplbCommunicator
        from vllm.distributed.eplb.eplb_state import EplbState, compute_logical_maps
        from vllm.distributed.parallel_state import get_ep_group

        self.model, self.E = model, num_logical
        layers = model.num_moe_layers
        initial = torch.tensor(EplbState.build_initial_global_physical_to_logical_map(num_logical, REDUNDANT))
        self.initial = initial.unsqueeze(0).expand(layers, -1).contiguous()
        l2p, counts = compute_logical_maps(self.initial, num_logical)
        l2p = torch.nn.functional.pad(l2p, (0, 1024 - l2p.shape[-1]), value=-1)  # add_model's 1023 + 1 slots
        p2l = self.initial.clone()
        # the fields _commit_eplb_maps reads and writes (an EplbModelState's)
        self.state = SimpleNamespace(physical_to_logical_map=p2l, physical_to_logical_map_buffer=p2l,
                                     logical_to_physical_map=l2p, logical_replica_count=counts)
        model.set_eplb_state(torch.zeros(layers, p2l.shape[1], dtype=torch.int32), l2p, counts)
        self.buffer = [torch.empty_like(w) for w in model.expert_weights[0]]
        self.group = get_ep_group()
        self.comm = TorchDistGlooStagedEplbCommunicator(self.group.cpu_group)

    @property
    def placement(self) -> torch.Tensor:
        return self.state.physical_to_logical_map.clone()

    def rebalance(self, seed: int) -> torch.Tensor:
        """vLLM's policy on random expert loads (the same on every rank), from the current placement."""
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

        g = torch.Generator().manual_seed(seed)
        loads = torch.randint(1, 1000, (self.model.num_moe_layers, self.E), generator=g)
        return DefaultEplbPolicy.rebalance_experts(loads, self.state.physical_to_logical_map.shape[1], 1, 1,
                                                   self.group.world_size, self.state.physical_to_logical_map)

    def move_to(self, new: torch.Tensor) -> None:
        """Move the weights between the EP ranks and commit the maps, as EplbState.rearrange does."""
        from vllm.distributed.eplb.eplb_state import _commit_eplb_maps
        from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

        rearrange_expert_weights_inplace(self.state.physical_to_logical_map, new, self.model.expert_weights,
                                         self.buffer, self.group.device_group, self.comm)
        _commit_eplb_maps(self.state, new)

    def loaded(self, weights: dict[str, torch.Tensor], cfg, history: list[torch.Tensor]) -> None:
        """vLLM's load_weights of `weights` (it writes the initial placement), then the rebalances of `history`."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(cfg):
            self.model.load_weights(iter([(k, v.clone()) for k, v in weights.items()]))
        from vllm.distributed.eplb.eplb_state import _commit_eplb_maps

        _commit_eplb_maps(self.state, self.initial.clone())
        for p in history:
            self.move_to(p)


def main() -> int:
    out, ckpts = Path(sys.argv[1]), sys.argv[2:5]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    harness.init_parallel(ckpts[0], world, rank)
    cfg, truth_cfg = eplb_config(ckpts[0], world), eplb_config(ckpts[0], world)  # a model registers its layers
    old, new, newer = (harness.load_checkpoint(c) for c in ckpts)
    spec = reshard.ModelSpec.from_hf_config(ckpts[0])
    src = reshard.parse_layout(SOURCE, spec)
    E = spec.num_experts
    engine_model, truth_model = harness.build_model(cfg), harness.build_model(truth_cfg)
    engine, truth = Eplb(engine_model, E), Eplb(truth_model, E)
    engine.loaded(old, cfg, [])
    results: dict[str, str] = {}
    facts: dict[str, object] = {}

    def check(name, fn):
        try:
            problem = fn()
            results[name] = "ok" if not problem else f"FAIL: {problem}"
        except Exception:  # noqa: BLE001 - reported, the test fails on it
            results[name] = "FAIL: " + traceback.format_exc(limit=8)

    def as_placement(p2l: torch.Tensor) -> reshard.ExpertPlacement:
        return reshard.ExpertPlacement.from_vllm(p2l, ranks=world, logical_experts=E)

    def layout(p2l: torch.Tensor | None) -> reshard.VllmLayout:
        return reshard.VllmLayout(model=spec, tp=world, expert_parallel=True, redundant_experts=REDUNDANT,
                                  expert_placement=None if p2l is None else as_placement(p2l))

    def reported() -> reshard.VllmLayout:
        """The layout a trainer follows: the placement the worker extension reports (`collective_rpc(
        "reshard_expert_placement")`), applied to the initial refit spec."""
        from reshard.adapters.vllm.worker import ReshardWorkerExtension

        class Worker(ReshardWorkerExtension):  # vLLM mixes the extension into its worker class so
            model_runner = SimpleNamespace(get_model=lambda: engine_model)
            vllm_config = cfg

        answer = json.loads(json.dumps(Worker().reshard_expert_placement()))  # as it travels
        spec0 = RefitSpec.of(spec, src, layout(None))
        return spec0.with_expert_placement(reshard.ExpertPlacement.model_validate(answer)).layouts()[1]

    engines: list = []
    import logging
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), backend="gloo")  # the drivers' own (EngineClient)
    logged: list[str] = []

    class Notes(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logging.getLogger("reshard.trainer").addHandler(Notes())

    def spec_of(dst, key, install="direct", transport="inprocess", fanout=None):
        return RefitSpec.of(spec, src, dst, install=install, transport=transport, options={"key": key},
                            verify_layers=list(range(spec.num_layers)), fanout=fanout)

    def worker_engine():
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        from reshard.adapters.vllm.engine import register

        register()
        worker = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), cfg,
                                                           torch.device("cpu"), engine_model)
        engines.append(worker)
        return worker

    def trainer(dst, weights, key, install="direct", transport="inprocess", fanout=None):
        """The `reshard` backend from vLLM's factories, worker and trainer side, each process its own engine
        worker, driven as the whole engine (EngineClient)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from reshard.adapters.vllm.trainer import ReshardTrainerInitInfo

        worker = worker_engine()
        info = ReshardTrainerInitInfo(refit=spec_of(dst, key, install, transport, fanout).to_dict(), rank=0)
        source = shard(src, weights) if transport == "inprocess" else {rank: shard(src, weights, ranks=[rank])[rank]}
        return WeightTransferTrainerFactory.trainer_init(info, client=EngineClient(worker, group), source=source)

    def refused(fn, *words) -> str | None:
        """fn must be refused on every worker of the engine -- its last worker raises, naming `words`; the others
        agree quietly and hold no session (adapters.vllm.session.agreed) -- with the engine's weights untouched."""
        before = snapshot(engine_model)
        try:
            fn()
        except reshard.ExecutionError as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                return f"the refusal does not name {missing}: {e}"
        else:
            if rank == world - 1:
                return "accepted"
        return same_bytes(engine_model, before) or None

    history: list[torch.Tensor] = []
    p0 = engine.placement

    # --- round 1: one rebalance, then a refit with NEW ---------------------------------------------------------
    p1 = engine.rebalance(seed=1)
    engine.move_to(p1)
    history.append(p1)
    facts["p0"], facts["p1"] = as_placement(p0).digest, as_placement(p1).digest

    def rebalance_moves_experts_between_ranks():
        S = p1.shape[1] // world
        moved = [(m, s) for m in range(p1.shape[0]) for s in range(p1.shape[1])
                 if int(p1[m, s]) not in p0[m, (s // S) * S:(s // S + 1) * S].tolist()]
        return None if moved else f"the rebalance moved no expert to another rank: {p1.tolist()}"

    def live_placement_is_eplbs():
        live, want = live_placement(engine_model, world), as_placement(p1)
        if live != want:
            return f"read {live}, vLLM's policy gave {want}"
        return None if reported() == layout(p1) else f"the worker extension reported {reported()}"

    def stale_plan_refused_at_init():
        # the failure users hit: a refit by the initial placement after a rebalance, refused by the engine
        worker = worker_engine()
        problem = refused(lambda: EngineClient(worker, group).init_weight_transfer_engine(
            spec_of(layout(None), "stale").to_dict()), "LayoutMismatchError", as_placement(p0).digest[:12],
            as_placement(p1).digest[:12])
        return problem or ("a worker holds a session of the stale plan" if worker.steps.session else None)

    def trainer_follows_a_stale_plan_at_init():
        # the same spec through a TrainerSession: the engine reports its placement, the trainer recompiles for it
        # and meets the engine again, by itself, before any byte moves
        poison(engine_model)
        t = trainer(layout(None), new, "follow-init")
        notes = t.session.followed
        want = [("init", as_placement(p0).digest, as_placement(p1).digest)]
        if [(n["step"], n["from"], n["to"]) for n in notes] != want:
            return f"followed {notes}, not {want}"
        t.send_weights(version="v0")
        t.shutdown()
        truth.loaded(new, truth_cfg, history)
        return same_bytes(engine_model, snapshot(truth_model))

    def stale_plan_would_corrupt():
        # what the refusal prevents: the initial placement's plan run anyway (into scratch copies), and vLLM's own
        # load_weights (which writes the initial placement), both differ from the truth
        truth.loaded(new, truth_cfg, history)
        want = snapshot(truth_model)
        stale = reshard.compile_plan(src, layout(None))
        scratch = {n: torch.full_like(t, float("nan")) for n, t in snapshot(engine_model).items()}
        ReferenceExecutor(stale, None, 0, shard(src, new), {rank: scratch}).refit()
        wrong = [n for n in want if "experts" in n and not torch.equal(scratch[n].view(torch.uint8),
                                                                       want[n].view(torch.uint8))]
        if not wrong:
            return "the initial placement's plan wrote what the rebalanced engine needs: the test shows nothing"
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(cfg):  # the reload users do today (the later checks poison the engine first)
            engine_model.load_weights(iter([(k, v.clone()) for k, v in new.items()]))
        if not [n for n in want if "experts" in n and n in same_bytes(engine_model, want)]:
            return "vLLM's load_weights after the rebalance wrote what the engine needs: the test shows nothing"
        return None

    def loader_install_refused():
        problem = refused(lambda: trainer(layout(p1), new, "loader", install="loader"), "load_weights writes "
                          "experts by the initial placement")
        return problem or ("a worker holds a loader session" if engines[-1].steps.session else None)

    def refit_matches_vllm_after_one_rebalance():
        poison(engine_model)
        t = trainer(reported(), new, "r1")  # the trainer follows the placement the engine reports
        t.send_weights(version="v1")
        t.shutdown()
        truth.loaded(new, truth_cfg, history)
        return same_bytes(engine_model, snapshot(truth_model))

    for name, fn in [("rebalance_moves_experts_between_ranks", rebalance_moves_experts_between_ranks),
                     ("live_placement_is_eplbs", live_placement_is_eplbs),
                     ("stale_plan_refused_at_init", stale_plan_refused_at_init),
                     ("stale_plan_would_corrupt", stale_plan_would_corrupt),
                     ("trainer_follows_a_stale_plan_at_init", trainer_follows_a_stale_plan_at_init),
                     ("loader_install_refused", loader_install_refused),
                     ("refit_matches_vllm_after_one_rebalance", refit_matches_vllm_after_one_rebalance)]:
        check(name, fn)

    # --- round 2: a trainer bound for p1; EPLB rebalances again before its next refit ----------------------------
    bound = trainer(layout(p1), newer, "r2")
    bound_worker = engines[-1]
    p2 = engine.rebalance(seed=2)
    engine.move_to(p2)
    history.append(p2)
    facts["p2"] = as_placement(p2).digest

    def refit_after_a_rebalance_since_init_refused():
        # the refit's first step on the engine (what the trainer's send_weights calls first): every worker reads its
        # EPLB state again, before any byte lands
        return refused(bound_worker.start_weight_update, "LayoutMismatchError", as_placement(p1).digest[:12],
                       as_placement(p2).digest[:12])

    def refit_follows_a_rebalance_by_itself():
        # the trainer bound for p1 refits after EPLB moved to p2: the engines refuse its start and report p2, the
        # trainer recompiles only the destination, meets them again and refits, in one send_weights call
        poison(engine_model)
        before = len(logged)
        bound.send_weights(version="v2")
        notes = [(n["step"], n["from"], n["to"]) for n in bound.session.followed]
        if notes != [("refit v2", as_placement(p1).digest, as_placement(p2).digest)]:
            return f"followed {bound.session.followed}"
        said = " ".join(logged[before:])
        if as_placement(p1).digest[:12] not in said or as_placement(p2).digest[:12] not in said:
            return f"the log does not name both placements: {logged[before:]}"
        truth.loaded(newer, truth_cfg, history)
        return same_bytes(engine_model, snapshot(truth_model))

    def refit_matches_vllm_after_two_rebalances():
        bound.shutdown()
        poison(engine_model)
        t = trainer(reported(), newer, "r3")
        t.send_weights(version="v3")
        t.shutdown()
        truth.loaded(newer, truth_cfg, history)
        return same_bytes(engine_model, snapshot(truth_model))

    def fan_out_feeds_redundant_slots_from_the_engine():
        # issue 42 item 3: with fan-out (a transport that relays: here reshard's torch.distributed executor over
        # vLLM's gloo world, each process one trainer rank and one EP rank), the trainer sends the engine one copy
        # of each expert and the redundant slots are fed by the EP rank that holds it (relays between the ranks)
        refit = spec_of(layout(p2), "fanout", transport="colocated", fanout=1)
        plan, a = refit.plan(), refit.plan().accounting
        ops = plan.ops
        expert = spec.canonical.expert[ops["canon"]] >= 0
        sent = int(((ops["rows"] * ops["cols"])[expert & (ops["src_side"] == 0)]).sum()) * plan.itemsize
        want = sum(t.numel for t in spec.tensors if spec.canonical.expert[t.index] >= 0) * plan.itemsize
        if sent != want:
            return f"the trainer sends {sent} bytes of experts, not one copy of each ({want})"
        if not a.slot_copy_bytes > a.slot_copy_local_bytes:
            return f"no slot copy crosses EP ranks: {a.slot_copy_bytes} B copied, {a.slot_copy_local_bytes} B locally"
        facts["slot_copies"] = {"bytes": a.slot_copy_bytes, "local": a.slot_copy_local_bytes, "expert_egress": sent,
                                "without": sum(reshard.compile_plan(src, layout(p2), expert_copies=False)
                                               .accounting.egress_bytes)}
        poison(engine_model)
        t = trainer(layout(p2), newer, "fanout", transport="colocated", fanout=1)
        t.send_weights(version="v4")
        t.shutdown()
        truth.loaded(newer, truth_cfg, history)
        return same_bytes(engine_model, snapshot(truth_model))

    def direct_binding_checks_loaders_by_the_initial_placement():
        # bind_direct probes vLLM's loaders (they write the initial placement) and binds the rebalanced engine
        binding = bind_direct(engine_model, layout(p2), rank, None, cfg)
        return None if binding.tensors else "nothing bound"

    check("refit_after_a_rebalance_since_init_refused", refit_after_a_rebalance_since_init_refused)
    check("refit_follows_a_rebalance_by_itself", refit_follows_a_rebalance_by_itself)
    check("refit_matches_vllm_after_two_rebalances", refit_matches_vllm_after_two_rebalances)
    check("fan_out_feeds_redundant_slots_from_the_engine", fan_out_feeds_redundant_slots_from_the_engine)
    check("direct_binding_checks_loaders_by_the_initial_placement",
          direct_binding_checks_loaders_by_the_initial_placement)
    for e in engines:
        e.shutdown()
    harness.write_json(out / f"rank{rank}.json", {"checks": results, "placements": facts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
