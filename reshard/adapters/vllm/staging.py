"""Where a worker stages a refit's bytes while its engine keeps generating (`RefitSpec(staging="device" | "host")`),
and the flip that makes them live. A staging holds one copy of the worker's shard and is refused at init when it
does not fit, naming both sizes.

A staged loader install on a CPU engine flips a `Shadow`: vLLM's CPU build packs every linear weight after loading,
so a loader install re-runs `load_weights` and that processing, here on a shadow of the module tree (fresh tensors of
the shapes vLLM recorded for reloading) while the engine still generates; the flip swaps the shadow's parameters in
(pointer assignments, no byte copied). The live model is only read until then. Needs `--enforce-eager`.
"""
from __future__ import annotations

import copy
from types import MethodType
from typing import Any

import torch

from ...errors import ExecutionError
from .live import config_scope
from .loader import LoaderInstaller

WHERE = ("device", "host")
HEADROOM = 256 << 20  # bytes left free beside the staging (allocator slack, the transport's own buffers)


def free_bytes(device: torch.device, where: str) -> int:
    """Bytes free where the staging would live: the device's free memory (CUDA), else the host's available memory
    (/proc/meminfo MemAvailable)."""
    if where == "device" and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ExecutionError("cannot tell the host's available memory (/proc/meminfo has no MemAvailable)")


def check_room(need: int, free: int, where: str, what: str) -> None:
    """Refuse a staging of `need` bytes where only `free` are free (less `HEADROOM`).

    Raises:
        ExecutionError: naming both sizes and what the staging holds.
    """
    if need + HEADROOM > free:
        raise ExecutionError(f"staging={where!r} needs {need / 2**30:.2f} GiB ({what}) and "
                             f"{HEADROOM / 2**30:.2f} GiB of headroom, but only {free / 2**30:.2f} GiB are free: "
                             f"stage on the host (staging='host'), free memory (a smaller KV cache), or stream "
                             f"(staging=None: the engine pauses for the whole refit)")


class Staging:
    """A staged copy of a worker's live tensors: the transport writes `tensors`; `flip` copies them into `live`.

    Args:
        live: the tensors a refit writes (plan destination names -> the live storage).
        where: "device" (beside the live tensors) or "host" (pinned host memory).
        what: what the tensors are, for the refusal's message.

    Raises:
        ExecutionError: the staging does not fit (`check_room`), or an unknown `where`.
    """

    def __init__(self, live: dict[str, torch.Tensor], where: str, what: str) -> None:
        if where not in WHERE:
            raise ExecutionError(f"staging={where!r} is not one of {WHERE}")
        self.live = live
        self.nbytes = sum(t.numel() * t.element_size() for t in live.values())
        self.device = next(iter(live.values())).device if live else torch.device("cpu")
        check_room(self.nbytes, free_bytes(self.device, where), where, what)
        pin = where == "host" and torch.cuda.is_available()
        self.tensors = {name: torch.empty(t.shape, dtype=t.dtype, device="cpu" if where == "host" else t.device,
                                          pin_memory=pin) for name, t in live.items()}

    @torch.no_grad()
    def flip(self) -> None:
        """Copy every staged tensor into its live one, queued, then waited for once. One `copy_` per tensor: faster
        on an H100 than `torch._foreach_copy_` (benchmarks/refit_flip.py)."""
        for name, live in self.live.items():
            live.copy_(self.tensors[name], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# a module's own bookkeeping, never swapped as an attribute
_STRUCTURE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def swaps(model: torch.nn.Module, device: torch.device, vllm_config: Any) -> bool:
    """Whether a staged loader install flips a shadow: a CPU engine without fused-MoE layers (a reload rebuilds their
    kernels) or LoRA, running eager (a compiled model may keep what it captured), its modules recorded for reloading."""
    if device.type != "cpu" or getattr(vllm_config, "lora_config", None) is not None \
            or not getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
        return False
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return not any(hasattr(getattr(m, "quant_method", None), "moe_kernel")
                   or (m._parameters and m not in LAYERWISE_INFO) for m in model.modules())


class Shadow:
    """A shadow of a loader install's model, built from its landed buffers while the engine generates and swapped
    in at the flip (see the module docstring).

    Args:
        installer: the loader install whose buffers the shadow loads.
    """

    def __init__(self, installer: LoaderInstaller) -> None:
        self.installer, self.model = installer, installer.model
        self.pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []  # (live, shadow) of modules with tensors
        self.nbytes = sum(t.numel() * t.element_size() for live in self.model.modules()
                          for t in _loaded_metas(live).values())

    def build(self) -> None:
        """Load the buffers into a fresh shadow (vLLM's `load_weights`) and process each layer with its own
        `quant_method`.

        Raises:
            ExecutionError: some weight of the model was not loaded (LoaderInstaller.load).
        """
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        self.pairs = []
        root = self._copy(self.model, {})
        twin = copy.copy(self.installer)  # the installer's own load, on the shadow
        twin.model = root
        with torch.no_grad(), config_scope(twin.vllm_config):
            twin.load()
            for _, shadow in self.pairs:
                method = getattr(shadow, "quant_method", None)
                if isinstance(method, QuantizeMethodBase):
                    shadow.__dict__.pop("_already_called_process_weights_after_loading", None)
                    method.process_weights_after_loading(shadow)
                    if hasattr(shadow, "update_param_tp_status"):
                        shadow.update_param_tp_status()

    def _copy(self, live: torch.nn.Module, memo: dict[int, torch.nn.Module]) -> torch.nn.Module:
        """The shadow of `live` and its children (a module shared by two parents, e.g. tied embeddings: once)."""
        if id(live) in memo:
            return memo[id(live)]
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        shadow = memo[id(live)] = copy.copy(live)
        absent = {n: None for n, t in live._parameters.items() if t is None}  # (a linear without bias)
        shadow.__dict__.update(_parameters=absent, _buffers=dict(live._buffers), _modules={},
                               _non_persistent_buffers_set=set(live._non_persistent_buffers_set))
        metas = _loaded_metas(live)
        if metas:
            with LAYERWISE_INFO[live].restore_device:
                for name, meta in metas.items():
                    tensor = restore_layer_refs(materialize_meta_tensor(meta), shadow)  # (a copy: meta untouched)
                    shadow._parameters[name] = tensor
            self.pairs.append((live, shadow))
        for name, child in live._modules.items():
            shadow._modules[name] = None if child is None else self._copy(child, memo)
        return shadow

    def swap(self) -> None:
        """Make the shadow live: each module takes the shadow's tensors and the attributes processing set (weight
        loaders bound to the shadow are bound to the live module again). Pointer assignments only."""
        for live, shadow in self.pairs:
            for key in [k for k in live.__dict__ if k not in shadow.__dict__]:
                del live.__dict__[key]
            for key, value in shadow.__dict__.items():
                if key not in _STRUCTURE and live.__dict__.get(key, _STRUCTURE) is not value:
                    live.__dict__[key] = value
            for name in [n for n in live._parameters if n not in shadow._parameters]:
                del live._parameters[name]
            for name, tensor in shadow._parameters.items():
                if tensor is not None:
                    _rebind(tensor, shadow, live)
                live._parameters[name] = tensor
            for name, buffer in shadow._buffers.items():  # (shared unless processing registered its own)
                if live._buffers.get(name) is not buffer:
                    live._buffers[name] = buffer
        self.pairs = []


def _loaded_metas(live: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of `live` that a load fills, as vLLM recorded them before its first processing (meta tensors:
    shapes, dtypes, loaders), and those vLLM never records (a linear's `bias`, built after its weights) as meta
    copies. Buffers (a rotary cache) are not loaded: the shadow shares the live ones."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, to_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import sanitize_layer_refs

    info = LAYERWISE_INFO.get(live)
    if info is None:
        return {}
    params, _ = info.restore_metadata
    late = {n: sanitize_layer_refs(to_meta_tensor(t), live) for n, t in live._parameters.items()
            if t is not None and n in SKIP_TENSORS}
    return {**params, **late}


def _rebind(tensor: torch.Tensor, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Methods of `old` a tensor carries (its weight loader) become methods of `new`."""
    for key, value in tensor.__dict__.items():
        if isinstance(value, MethodType) and value.__self__ is old:
            tensor.__dict__[key] = value.__func__.__get__(new)
