"""One EP rank of an EPLB engine (vLLM 0.33's own code on CPU, eplb_checks.Eplb) refit through the NeMo-RL
integration's receive path; launched by test_vllm_eplb_integrations.py, one process per EP rank. Writes
rank{r}.json: per check, "ok" or what failed, and the placements' digests.

Each rank is one vLLM worker of the engine and holds a `ReshardCheckpointEngine` as NeMo-RL's worker extension does
(`Worker` below: the extension mixed into vLLM's worker, `self.checkpoint_engine`, `async for batch in
receive_weight_batches(): load_weights(batch)`); rank 0 also runs the one policy worker, on a thread. The engines
meet as NeMo-RL's synchronizer makes them (prepare, every result gathered in order, init process groups).

1. Before any rebalance (vLLM's initial placement, 4 redundant experts): the refit lands byte-identical to vLLM's
   own `load_weights` of the same checkpoint (the truth model), replicas included.
2. After vLLM's policy rebalanced the engine and its rearrangement moved the weights between the ranks: the next
   refit is refused at its start on every vLLM worker, naming the engine's placement and vLLM's initial one; the
   policy worker's `send_weights` raises with that reason; the model holds exactly the bytes it held before (vLLM's
   `load_weights` would have written experts by the initial placement: eplb_checks' `stale_plan_would_corrupt`).

usage: integrations_eplb_checks.py OUT_DIR CKPT_OLD CKPT_NEW CKPT_NEWER
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

import vllm_harness as harness  # noqa: E402
import reshard  # noqa: E402
from eplb_checks import Eplb, eplb_config  # noqa: E402
from rank_checks import same_bytes, snapshot  # noqa: E402
from reshard.integrations.nemo_rl import ReshardCheckpointEngine  # noqa: E402

BUCKET = 1 << 18  # bytes: the tiny model moves in several groups


class Worker:
    """NeMo-RL's vLLM worker extension as vLLM mixes it into its worker (`self` has model_runner, vllm_config)."""

    def __init__(self, model, vllm_config, engine) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config, self.checkpoint_engine = vllm_config, engine

    def update_weights_from_checkpoint_engine(self) -> bool:
        return asyncio.run(self._update())

    async def _update(self) -> bool:
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            async for batch in self.checkpoint_engine.receive_weight_batches():
                model.load_weights(weights=batch)
        return True


def gather(out: Path, key: str, rank: int, world: int, value) -> list:
    """Every rank's `value` in rank order (NeMo-RL's driver gathering prepare() results), through files."""
    import torch.distributed as dist

    tmp = out / f"{key}-{rank}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.rename(out / f"{key}-{rank}.json")
    dist.barrier()
    return [json.loads((out / f"{key}-{r}.json").read_text()) for r in range(world)]


def main() -> int:
    out, ckpts = Path(sys.argv[1]), sys.argv[2:5]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    harness.init_parallel(ckpts[0], world, rank)
    cfg, truth_cfg = eplb_config(ckpts[0], world), eplb_config(ckpts[0], world)
    old, new, newer = (harness.load_checkpoint(c) for c in ckpts)
    E = reshard.ModelSpec.from_hf_config(ckpts[0]).num_experts
    model, truth_model = harness.build_model(cfg), harness.build_model(truth_cfg)
    engine, truth = Eplb(model, E), Eplb(truth_model, E)
    engine.loaded(old, cfg, [])
    results: dict[str, str] = {}
    facts: dict[str, object] = {}

    def check(name, fn):
        try:
            problem = fn()
            results[name] = "ok" if not problem else f"FAIL: {problem}"
        except Exception:  # noqa: BLE001 - reported, the test fails on it
            results[name] = "FAIL: " + traceback.format_exc(limit=8)

    def digest(p2l: torch.Tensor) -> str:
        return reshard.ExpertPlacement.from_vllm(p2l, ranks=world, logical_experts=E).digest[:12]

    # the engines meet as NeMo-RL's synchronizer makes them: policy worker 0 (on rank 0), then the vLLM workers
    def construct() -> ReshardCheckpointEngine:
        return ReshardCheckpointEngine(BUCKET, model=ckpts[0], device="cpu", timeout=60.0)

    rollout = construct()
    policy = construct() if rank == 0 else None
    policy_meta = gather(out, "policy", rank, world, policy.prepare() if policy else None)[0]
    metadata = [policy_meta, *gather(out, "rollout", rank, world, rollout.prepare())]
    sizes = {"train_world_size": 1, "rollout_world_size": world, "metadata": metadata}
    sent: list = []

    def policy_side(weights) -> threading.Thread:
        """Policy worker 0's send_weights on a thread of rank 0 (NeMo-RL: its own Ray actor); its error, if any,
        lands in `sent`."""
        def run():
            try:
                asyncio.run(policy.send_weights(iter(list(weights.items()))))
                sent.append(None)
            except Exception as e:  # noqa: BLE001 - what the policy worker's caller would see
                sent.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    joining = threading.Thread(target=lambda: policy.init_policy_process_group(worker_rank=0, **sizes),
                               daemon=True) if policy else None
    if joining:
        joining.start()
    rollout.init_rollout_process_group(rollout_rank=rank, **sizes)
    if joining:
        joining.join()
    worker = Worker(model, cfg, rollout)
    p0 = engine.placement
    facts["p0"] = digest(p0)

    def refit_matches_vllm_before_a_rebalance():
        thread = policy_side(new) if policy else None
        worker.update_weights_from_checkpoint_engine()
        if thread:
            thread.join()
            if sent[-1] is not None:
                return f"the policy worker raised: {sent[-1]}"
        truth.loaded(new, truth_cfg, [])  # vLLM's load_weights of the same checkpoint, initial placement
        return same_bytes(model, snapshot(truth_model))

    check("refit_matches_vllm_before_a_rebalance", refit_matches_vllm_before_a_rebalance)

    # vLLM's policy rebalances on random loads, its rearrangement moves the weights between the EP ranks
    p1 = engine.rebalance(seed=1)
    engine.move_to(p1)
    facts["p1"] = digest(p1)

    def refit_after_a_rebalance_refused_before_any_byte_lands():
        before = snapshot(model)
        thread = policy_side(newer) if policy else None
        try:
            worker.update_weights_from_checkpoint_engine()
        except reshard.LayoutMismatchError as e:
            said = facts["refusal"] = str(e)
        else:
            return "the refit was accepted"
        finally:
            if thread:
                thread.join(timeout=120)
        missing = [d for d in (facts["p0"], facts["p1"]) if d not in said]
        if missing:
            return f"the refusal does not name {missing}: {said}"
        if policy:
            if not sent or sent[-1] is None:
                return "the policy worker's send_weights returned"
            facts["policy_error"] = str(sent[-1])
            if facts["p1"] not in str(sent[-1]):
                return f"the policy worker's error does not say why: {sent[-1]}"
        return same_bytes(model, before) or None

    check("refit_after_a_rebalance_refused_before_any_byte_lands",
          refit_after_a_rebalance_refused_before_any_byte_lands)
    for e in (rollout, policy):
        if e is not None:
            e.finalize()
    harness.write_json(out / f"rank{rank}.json", {"checks": results, "placements": facts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
