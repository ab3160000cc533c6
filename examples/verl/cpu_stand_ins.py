"""What verl runs on GPUs, stood in for on CPU, for examples/verl/refit.py (an importable module, so that Ray ships
these classes to its workers by reference): trainer workers are verl's ActorRolloutRefWorker (its own
`update_weights`) whose engine streams a transformers model's gathered HF tensors, as verl's FSDP engine does;
rollout workers are verl's CheckpointEngineWorker whose server adapter loads what arrives into a transformers
model, strictly, as vLLM's `load_weights` would."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import BaseRollout, RolloutReplica


def scores(model, sequences: list[list[int]]) -> list[list]:
    """The model's log-probability of each token after the first and its argmax there, per sequence (plain lists,
    reshard.verify's Scores): what the train-inference mismatch check compares."""
    from reshard.verify import hf_model_scores

    s = hf_model_scores(model.eval(), sequences)
    return [[list(lp), list(am)] for lp, am in zip(s.logprobs, s.argmax)]


def fingerprint(named) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in named}


class Trainer(ActorRolloutRefWorker):
    """verl's trainer worker; only init_model differs (verl's builds an FSDP / Megatron engine on GPUs)."""

    def __init__(self, config, role: str, model_path: str) -> None:
        super().__init__(config, role)
        self.model_path = model_path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        torch.distributed.init_process_group("gloo")
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        # the engine behind get_per_tensor_param: gathered HF tensors, the same stream on every trainer rank
        self.actor = SimpleNamespace(engine=SimpleNamespace(model=model, get_per_tensor_param=lambda **_: (
            iter(list(model.state_dict().items())), None)))
        ce: CheckpointEngineConfig = omega_conf_to_dataclass(self.config.rollout.checkpoint_engine)
        import_external_libs(ce.custom_backend_module)  # as verl's init_model: registers "reshard"
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce.backend, is_master=torch.distributed.get_rank() == 0,
            bucket_size=ce.update_weights_bucket_megabytes << 20, **ce.engine_kwargs[ce.backend])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> dict[str, str]:
        with torch.no_grad():  # the same update on every data-parallel rank
            for k, (_, p) in enumerate(sorted(self.actor.engine.model.named_parameters())):
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 997 + k)))
        return fingerprint(self.actor.engine.model.state_dict().items())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scores(self, sequences: list[list[int]]) -> list[list]:
        return scores(self.actor.engine.model, sequences)


class HfServer(BaseRollout):
    """Stands in for vLLM's server adapter: loads what arrives into the served model, strictly."""

    def __init__(self, config: RolloutConfig, model_path: str) -> None:
        super().__init__(config, None, device_mesh=None)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    async def update_weights(self, weights, global_steps=None, **kwargs):
        received = {name: tensor.clone() async for name, tensor in weights}
        self.model.load_state_dict(received, strict=True)

    async def resume(self, tags):
        pass

    async def release(self):
        pass


class Rollout(CheckpointEngineWorker):
    def __init__(self, rollout_config: RolloutConfig, model_path: str) -> None:
        super().__init__(rollout_config, None, HfServer(rollout_config, model_path))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def served(self) -> dict[str, str]:
        return fingerprint(self.server_adapter.model.state_dict().items())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scores(self, sequences: list[list[int]]) -> list[list]:
        return scores(self.server_adapter.model, sequences)


class Replica(RolloutReplica):  # no inference server on CPU: nothing to abort or resume
    def get_ray_class_with_init_args(self):
        raise NotImplementedError

    async def launch_servers(self):
        pass
