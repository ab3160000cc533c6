"""verl's checkpoint-engine backends side by side: one run, one model, one CPU cluster, verl's own manager.

    .venv-verl/bin/python benchmarks/verl_backends.py [--layers 10] [--vocab 151936] [--bucket-mb 256] [--refits 3]
        [--rows funnel,nixl,reshard-bucket,...] [--json PATH]

verl's real `CheckpointEngineManager.update_weights` drives every backend between the same workers over a local Ray
cluster (CPU resource pools, as harness.verl_cpu does): 2 trainer ranks (verl's `ActorRolloutRefWorker`,
its own `update_weights`, which streams `engine.get_per_tensor_param()` into the backend) and 3 rollout workers
(verl's `CheckpointEngineWorker`, whose server adapter stands in for vLLM's `load_weights`: it copies every received
tensor into the weights it serves). The model: random bf16 tensors with a real model's HF names, shapes and order
(transformers' Qwen3 state dict on the meta device; Qwen3-1.7B's widths, `--layers` of its 28 layers, untied
embeddings as in Qwen3-8B). Both trainer ranks stream the same tensors (verl hands every rank the gathered HF
tensors), mapped from one file in /dev/shm so the model is in memory once on the trainer side.

Rows (`--rows`; all by default; ROWS below is the one place that says what each runs):
  funnel          harness.verl_cpu's FunnelCheckpointEngine, NOT verl code: verl's NCCL engine's pattern
                  (trainer rank 0 broadcasts buckets to every rollout worker, the other trainer ranks drain) over gloo
  nixl            verl's own NIXLCheckpointEngine with device="cpu" (a chain: trainer rank 0 -> rollout 0 -> 1 -> 2,
                  each reading its predecessor's bucket), run on CPU through three shims confined to that module:
                  a stand-in `cupy` module while it imports (never called with device="cpu"), `pin_memory` dropped
                  (a CPU-only torch has no pinned allocator) and `torch.cuda.synchronize` a no-op; needs pyzmq
  reshard-*       reshard's backend (gloo), with the options RESHARD_ROWS gives
  naive           verl's own colocated path (ColocatedCheckpointEngine): each trainer rank loads a rollout in its
                  own process; no transfer, two replicas (one per trainer rank), not three: a reference, not a peer.
                  CPU shims: verl's device synchronize and GPU-memory logging are no-ops in the trainer processes

Per row, after one warm-up refit, `--refits` timed refits (verl's whole update_weights, prepare to finalize), each
followed by a check that every receiver serves exactly the trainer's bytes (SHA-1 per tensor, the trainer's against
each receiver's; the trainer changes every tensor before every refit, so stale bytes fail it): a row whose check
fails prints `WRONG` and its times do not count. Columns:
  refit s         median (min-max) wall seconds of the timed refits
  x memcpy        refit time over the bytes every receiver must end up with (receivers x model) at one thread's
                  memcpy bandwidth (the faster of: from the shared file, between anonymous buffers; measured before
                  the cluster starts and after it stops; the faster counts): the host's copy ceiling
  x gloo          the same over trainer rank 0 -> 1 gloo send/recv of the model (one TCP stream between two
                  processes, as the gloo rows use; measured when the cluster starts and before it stops)
  egress          per trainer rank, what the backend hands its transport (reshard: its executor's sent bytes; funnel:
                  its own count, which assumes a flat broadcast; nixl: the bytes trainer rank 0 exposes to its
                  successor; naive: nothing moves)
  write()         per trainer rank, the bytes the process passed to write()/writev() during the refit (/proc/self/io
                  wchar): gloo's TCP sends show there (a measurement of the gloo rows' egress independent of the
                  backends' own counts); NIXL's one-sided reads never do
  peak/receiver   the rollout worker process's peak RSS growth: the kernel's VmHWM, reset through
                  /proc/self/clear_refs before each refit, minus the process's RSS before the row's warm-up refit
                  (its engine freshly made; gc and malloc_trim before every reading), so buffers a backend keeps
                  across refits count; the largest over receivers and timed refits. The served weights are resident
                  before (not counted): this is what the backend needs beyond them
The JSON (--json) has every refit's figures per process, the trainers' memory and the receivers' write() bytes
(relays) too.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
# pyzmq for verl's NIXL engine, installed beside (not into) the shared verl virtualenv:
#   .venv-verl/bin/pip install --target .venv-verl-extras pyzmq
EXTRAS = ROOT / ".venv-verl-extras"
if str(ROOT) not in sys.path:  # `benchmarks.verl_backends` and this checkout's reshard, in the driver too
    sys.path.insert(0, str(ROOT))
if EXTRAS.is_dir() and str(EXTRAS) not in sys.path:
    sys.path.append(str(EXTRAS))
from benchmarks import _harness_path  # noqa: E402,F401 - tests/ (the harness) on the path, here and in children

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry, CheckpointEngineWorker  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402
from verl.workers.rollout import BaseRollout  # noqa: E402

from harness import verl_cpu as vc  # noqa: E402  (also registers the "funnel" backend)

MODULE = "benchmarks.verl_backends"  # verl imports this (custom_backend_module) in driver, trainers and rollouts

# --- what each row runs: the one place to change when a backend's options change -------------------------------
# The reshard backend's options per row. `staging` replaces `atomic` (issue 39): "bucket" hands each tensor group on
# once every process agreed on it, "model" only after the whole model arrived (all or nothing). Where this checkout's
# backend predates `staging`, resolve_reshard_options runs the nearest `atomic` setting and the row says so.
RESHARD_ROWS: dict[str, dict[str, Any]] = {
    "reshard-bucket": {"staging": "bucket"},
    "reshard-model": {"staging": "model"},
    "reshard-bucket-fanout1": {"staging": "bucket", "fanout": 1},
}
RESHARD_COMMON: dict[str, Any] = {"timeout": 600.0}  # seconds a process waits for a peer (a loaded 2-core host)
ROWS: tuple[str, ...] = ("funnel", "nixl", *RESHARD_ROWS, "naive")

# Qwen3-1.7B's widths (its config.json), layers and vocabulary from the command line, embeddings untied.
QWEN3_1_7B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
              "intermediate_size": 6144, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960, "hidden_act": "silu",
              "attention_bias": False, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
ALIGN = 64  # bytes: each tensor of the shared file starts on a cache line


# --- the model: names, shapes, order; one shared file of weights --------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Where the trainer's bf16 tensors sit in the shared file, in the order a trainer streams them."""

    path: str
    total: int
    tensors: tuple[tuple[str, tuple[int, ...], int], ...]  # (HF name, shape, byte offset)

    @property
    def model_bytes(self) -> int:
        return sum(2 * _numel(shape) for _, shape, _ in self.tensors)

    def views(self, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape, offset in self.tensors:
            yield name, flat[offset:offset + 2 * _numel(shape)].view(torch.bfloat16).view(shape)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "total": self.total, "tensors": [[n, list(s), o] for n, s, o in self.tensors]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Layout":
        return cls(d["path"], d["total"], tuple((n, tuple(s), o) for n, s, o in d["tensors"]))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def model_config(layers: int, vocab: int) -> dict[str, Any]:
    return {**QWEN3_1_7B, "num_hidden_layers": layers, "vocab_size": vocab}


def hf_tensors(config_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' own state dict of the model (meta device: no memory): the names, shapes and order an FSDP
    trainer streams. Checked against reshard's ModelSpec, which plans from the config alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reshard.layouts import ModelSpec

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    tensors = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    spec = {t.name: tuple(t.shape) for t in ModelSpec.from_hf_config(str(config_dir / "config.json")).tensors}
    if spec != dict(tensors):
        raise SystemExit(f"reshard's ModelSpec and transformers disagree on the model: {set(spec) ^ dict(tensors).keys()}")
    return tensors


def make_weights(tensors: list[tuple[str, tuple[int, ...]]], path: str, seed: int = 0) -> Layout:
    """Random normal bf16 weights in one file under /dev/shm (tmpfs: in memory once, mapped by both trainer ranks)."""
    entries, offset = [], 0
    for name, shape in tensors:
        entries.append((name, shape, offset))
        offset += -(-2 * _numel(shape) // ALIGN) * ALIGN
    layout = Layout(path, offset, tuple(entries))
    with open(path, "wb") as f:
        f.truncate(layout.total)
    flat = torch.from_file(path, shared=True, size=layout.total, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    for _, view in layout.views(flat):
        view.normal_(0.0, 0.02, generator=gen)
    return layout


def digest(t: torch.Tensor) -> str:
    """SHA-1 of the tensor's bytes (integrity against a broken or stale refit, not an adversary; faster than SHA-256
    on this host, and every check hashes the model four times)."""
    return hashlib.sha1(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())).hexdigest()


def copy_ceiling(path: str) -> dict[str, float]:
    """The model's bytes copied by one thread: from the shared file the trainers stream (tmpfs pages) and between
    two anonymous buffers (where the receivers' weights live); the faster is the ceiling (the generous one)."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    out = {"from the shared file": memcpy_seconds(np.asarray(mapped))}
    private = np.array(mapped)  # an anonymous copy
    del mapped
    out["anonymous to anonymous"] = memcpy_seconds(private)
    del private
    return out


def memcpy_seconds(src: np.ndarray, repeats: int = 3) -> float:
    """One thread's copy of `src` into a buffer already faulted in (np.copyto: a single memcpy); best of repeats."""
    dst = np.empty_like(src)
    np.copyto(dst, src)  # faults dst in: the receivers' weights are resident before a refit too
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    del dst
    return best


# --- per-process measurements (run inside the workers) ---------------------------------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


class Meter:
    """Peak RSS growth and write() bytes of this process between begin() and end(). The peak comes from the
    kernel's high-water mark, reset through /proc/self/clear_refs ("5"); where that is refused, a thread samples
    VmRSS every 5 ms (it can miss a peak shorter than that) and `method` says so. Growth is counted from the RSS at
    the row's first begin() (the backend's engine freshly made, before its warm-up refit), so buffers a backend
    allocates once and keeps across refits count too; `held` is what it kept from one refit to the next."""

    def __init__(self) -> None:
        self.method = "VmHWM (clear_refs)"
        self._sampling = False
        self._peak = 0
        self._row0 = 0
        self._rss0 = 0
        self._wchar0 = 0

    def begin(self, row_start: bool) -> None:
        gc.collect()
        try:  # give back what earlier refits freed, so a baseline is what is in use, not what glibc kept
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "VmRSS sampled every 5 ms"
            self._start_sampler()
        self._rss0 = _status_kib("VmRSS")
        if row_start:
            self._row0 = self._rss0
        self._peak = self._rss0
        self._wchar0 = _io()["wchar"]

    def _start_sampler(self) -> None:
        self._sampling = True

        def run() -> None:
            while self._sampling:
                self._peak = max(self._peak, _status_kib("VmRSS"))
                time.sleep(0.005)

        threading.Thread(target=run, daemon=True).start()

    def end(self) -> dict[str, Any]:
        wchar = _io()["wchar"]
        if self._sampling:
            self._sampling = False
            peak = self._peak
        else:
            peak = _status_kib("VmHWM")
        return {"rss_row_start": self._row0 << 10, "held": max(0, self._rss0 - self._row0) << 10,
                "peak_growth": max(0, peak - self._row0) << 10, "wchar": wchar - self._wchar0,
                "method": self.method}


def _dump_stacks_on_signal() -> None:
    """SIGUSR1 prints every thread's stack to the worker's stderr (Ray's worker-*.err): what a refit that overran
    its time was waiting for."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)


class SharedExport:
    """Stands in for verl's training engine behind `get_per_tensor_param`: the gathered HF tensors, views of the
    shared file (zero-cost to produce, so the refit's time is the backend's)."""

    is_param_offload_enabled = False

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.flat = torch.from_file(layout.path, shared=True, size=layout.total, dtype=torch.uint8)
        int(self.flat[::4096].sum())  # map every page now: the rows' memory figures count no first touch of them

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.layout.views(self.flat)

    def get_per_tensor_param(self, **_: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        return self.named(), None

    def train_step(self, step: int) -> None:
        """Change every tensor (every 997th element, from the first, set to the step): each refit must move bytes
        the previous one did not. An assignment, not an update, so it reads the same whoever runs it."""
        for _, view in self.named():
            view.view(-1)[::997] = float(step)


class ServedWeights(BaseRollout):
    """Stands in for vLLM's server adapter: weights allocated and resident before any refit; `update_weights`
    copies each received tensor into them (as `load_weights` does) and refuses an unknown name or shape and a refit
    that leaves a tensor unset."""

    def __init__(self, config: RolloutConfig | None, layout: Layout) -> None:
        if config is not None:
            super().__init__(config, None, device_mesh=None)
        self.weights = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape, _ in layout.tensors}
        self.version: int | None = None

    async def update_weights(self, weights: Any, global_steps: int | None = None, **_: Any) -> None:
        got: set[str] = set()
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                self._load(name, tensor, got)
        else:
            for name, tensor in weights:
                self._load(name, tensor, got)
        missing = sorted(set(self.weights) - got)
        if missing:
            raise ValueError(f"load_weights: the refit left {missing[:3]} ({len(missing)}) unset")
        self.version = global_steps

    def _load(self, name: str, tensor: torch.Tensor, got: set[str]) -> None:
        have = self.weights.get(name)
        if have is None or have.shape != tensor.shape or have.dtype != tensor.dtype:
            raise ValueError(f"load_weights: {name} {tuple(tensor.shape)} {tensor.dtype} is not a served tensor")
        have.copy_(tensor)
        got.add(name)

    def digests(self) -> tuple[int | None, dict[str, str]]:
        return self.version, {name: digest(t) for name, t in self.weights.items()}

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass


class _NoDevice:
    """verl's device module on a host without one, for the naive path only: nothing to synchronize or empty."""

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


class BenchTrainer(ActorRolloutRefWorker):
    """verl's trainer worker (its own update_weights); init_model maps the shared weights and builds the checkpoint
    engine as verl's does (harness.verl_cpu.new_engine)."""

    def __init__(self, config: Any, role: str, layout: dict[str, Any]) -> None:
        super().__init__(config, role)
        self.layout = Layout.from_dict(layout)
        self.meter = Meter()
        _dump_stacks_on_signal()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from omegaconf import OmegaConf

        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        self.actor = types.SimpleNamespace(engine=SharedExport(self.layout))
        # what verl's init_model sets for its naive (colocated) path
        self.base_sync_done, self.layered_summon, self.peft_merge = True, False, False
        self.rollout = None
        self.checkpoint_engine = vc.new_engine(OmegaConf.to_container(self.config.rollout.checkpoint_engine),
                                               is_master=(torch.distributed.get_rank() == 0))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reconfigure(self, ce: dict[str, Any]) -> None:
        self.checkpoint_engine = None
        gc.collect()
        self.checkpoint_engine = vc.new_engine(ce, is_master=(torch.distributed.get_rank() == 0))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def colocate(self, on: bool) -> None:
        """The naive row: a rollout in this process (its weights resident), verl's CPU-less device calls made no-ops
        in verl's worker module only; off frees it."""
        import verl.workers.engine_workers as ew

        if on:
            if not torch.cuda.is_available():
                ew.get_torch_device = lambda: _NoDevice
                ew.log_gpu_memory_usage = lambda *a, **k: None
            self.rollout = ServedWeights(None, self.layout)
        else:
            self.rollout = None
            gc.collect()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> None:
        if torch.distributed.get_rank() == 0:  # one writer: the file is shared
            self.actor.engine.train_step(step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def expected(self) -> dict[str, str] | None:
        if torch.distributed.get_rank() != 0:
            return None
        return {name: digest(t) for name, t in self.actor.engine.named()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gloo_seconds(self, chunk: int = 128 << 20, repeats: int = 2) -> float:
        """The transport's ceiling: trainer rank 0 sends the model's bytes (the shared file, in `chunk`-byte
        messages) to trainer rank 1 over the trainers' gloo group (TCP on this host, as the gloo backends use), rank 1
        receiving into one chunk-sized buffer; best of `repeats`, the slower rank's view."""
        rank = torch.distributed.get_rank()
        flat = self.actor.engine.flat[:self.layout.total]
        buf = torch.empty(chunk, dtype=torch.uint8)
        best = float("inf")
        for _ in range(repeats):
            torch.distributed.barrier()
            start = time.perf_counter()
            for offset in range(0, flat.numel(), chunk):
                n = min(chunk, flat.numel() - offset)
                if rank == 0:
                    torch.distributed.send(flat[offset:offset + n], dst=1)
                elif rank == 1:
                    torch.distributed.recv(buf[:n], src=0)
            torch.distributed.barrier()
            best = min(best, time.perf_counter() - start)
        return best

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def colocated_served(self) -> tuple[int | None, dict[str, str]]:
        return self.rollout.digests()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def meter_begin(self, row_start: bool) -> None:
        self.meter.begin(row_start)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def meter_end(self) -> dict[str, Any]:
        return self.meter.end()


class BenchRollout(CheckpointEngineWorker):
    def __init__(self, rollout_config: RolloutConfig, layout: dict[str, Any]) -> None:
        super().__init__(rollout_config, None, ServedWeights(rollout_config, Layout.from_dict(layout)))
        self.meter = Meter()
        _dump_stacks_on_signal()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reconfigure(self, ce: dict[str, Any]) -> None:
        self.checkpoint_engine = None
        gc.collect()
        self.checkpoint_engine = vc.new_engine(ce)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def served(self) -> tuple[int | None, dict[str, str]]:
        return self.server_adapter.digests()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def meter_begin(self, row_start: bool) -> None:
        self.meter.begin(row_start)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def meter_end(self) -> dict[str, Any]:
        return self.meter.end()


# --- verl's stock backends on this host ------------------------------------------------------------------------

class _CpuTorch(types.ModuleType):
    """`torch` as verl's NIXL module sees it on a CPU-only build: `zeros(pin_memory=True)` without the pinning (no
    pinned allocator exists without an accelerator) and `cuda.synchronize()` a no-op (nothing is asynchronous on
    the CPU path). Everything else is torch."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(synchronize=lambda *a, **k: None)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **kwargs)


NIXL_UNAVAILABLE: str | None = None


def register_nixl_cpu() -> str | None:
    """Register verl's NIXLCheckpointEngine (as "nixl") for device="cpu" on this host; returns why not, or None.
    verl's package import records the real import failures first (cupy missing for nccl/nixl), then the NIXL module
    is imported again with a stand-in `cupy` (its CPU path never calls it) and its `torch` swapped for _CpuTorch."""
    import verl.checkpoint_engine  # noqa: F401 - first, so verl's own import errors are recorded unshimmed

    if torch.cuda.is_available():
        return "a CUDA host: run verl's own nixl backend instead of this CPU shim"
    try:
        import zmq  # noqa: F401
    except ImportError as e:
        return f"pyzmq is missing ({e}): .venv-verl/bin/pip install --target .venv-verl-extras pyzmq"
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        return f"nixl is missing ({e})"
    stand_in = "cupy" not in sys.modules and importlib.util.find_spec("cupy") is None
    if stand_in:
        sys.modules["cupy"] = types.ModuleType("cupy")
    try:
        module = importlib.import_module("verl.checkpoint_engine.nixl_checkpoint_engine")
    finally:
        if stand_in:
            del sys.modules["cupy"]
    module.torch = _CpuTorch()

    class NixlOnCpu(module.NIXLCheckpointEngine):
        """verl's NIXLCheckpointEngine unchanged but for the module shims; send_weights also returns the bytes it
        handed its successor (verl's returns nothing)."""

        async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
            sent = [0]

            def counted() -> Iterator[tuple[str, torch.Tensor]]:
                for name, tensor in weights:
                    if self.rank == 0:
                        sent[0] += tensor.nbytes
                    yield name, tensor

            await super().send_weights(counted(), global_steps=global_steps)
            return {f"nixl/trainer{torch.distributed.get_rank()}/egress_bytes": float(sent[0])}

    CheckpointEngineRegistry.register("nixl")(NixlOnCpu)
    return None


# verl imports this module in each process that makes a backend (custom_backend_module): register there
NIXL_UNAVAILABLE = register_nixl_cpu()

# Why each stock backend of verl 0.9.1 cannot run on this host (2 CPU cores, no GPU, no RDMA): the static part;
# verl's own import error for each module is printed beside it at run time.
STOCK: dict[str, tuple[str, str]] = {
    "nccl": ("nccl_checkpoint_engine", "imports cupy at module level; buffers are cupy/torch CUDA tensors and the "
             "group is ray.util.collective with backend 'nccl' (CUDA GPUs only)"),
    "nixl": ("nixl_checkpoint_engine", "imports cupy and zmq at module level; device='cpu' allocates pinned "
             "buffers and calls torch.cuda.synchronize(), both refused by a CPU-only torch (runs here only with "
             "the shims above)"),
    "kimi_ckpt_engine": ("kimi_checkpoint_engine", "needs MoonshotAI's checkpoint-engine package, whose "
                         "ParameterServer refuses a host without CUDA or NPU (DeviceManager: 'The current device "
                         "type is not supported') and pulls over RDMA (mooncake p2p store); group backend vllm_nccl"),
    "mooncake": ("mooncake_checkpoint_engine", "needs mooncake's TransferEngine with protocol 'rdma' (hard-coded "
                 "unless NPU), vLLM's or SGLang's StatelessProcessGroup, and divides by the CUDA device count"),
    "nccl (hccl)": ("hccl_checkpoint_engine", "registers as 'nccl' on Ascend NPUs only (raises ImportError without "
                    "torch.npu); needs vLLM and zmq"),
    "delta_sharded": ("delta_checkpoint_engine", "built on the NCCL engine (cupy, CUDA, ray.util.collective nccl); "
                      "gets the training engine, not a stream"),
}


def stock_report() -> list[tuple[str, bool, str, str]]:
    """(name, registered by verl's own import, verl's recorded import error, why it cannot run on this host)."""
    errors = getattr(CheckpointEngineRegistry, "_import_errors", {})
    rows = []
    for name, (module, why) in STOCK.items():
        rows.append((name, module not in errors, str(errors.get(module, "")), why))
    return rows


# --- the cluster -------------------------------------------------------------------------------------------------

def resolve_reshard_options(options: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The row's options as this checkout's reshard backend takes them; a note when they had to be translated."""
    from reshard.errors import ArgumentError
    from reshard.integrations.verl import topology

    full = {**RESHARD_COMMON, **options}
    try:
        return topology.check_options(full), None
    except ArgumentError:
        known = getattr(topology, "_OPTIONS", {})
        if "staging" in full and "staging" not in known and "atomic" in known:
            legacy = {k: v for k, v in full.items() if k != "staging"}
            legacy["atomic"] = full["staging"] == "model"
            return topology.check_options(legacy), (f"backend predates 'staging': ran atomic={legacy['atomic']} for "
                                                    f"staging={full['staging']}")
        raise


def checkpoint_engine(row: str, config_dir: str, bucket_mb: int) -> tuple[dict[str, Any], str | None]:
    """verl's checkpoint_engine config block for a row (and a note on it)."""
    base = {"_target_": "verl.workers.config.CheckpointEngineConfig", "update_weights_bucket_megabytes": bucket_mb}
    if row in RESHARD_ROWS:
        options, note = resolve_reshard_options(RESHARD_ROWS[row])
        return {**base, "backend": "reshard", "custom_backend_module": "reshard.integrations.verl",
                "engine_kwargs": {"reshard": {"model": config_dir, **options}}}, note
    kwargs = {"funnel": {"timeout": 600.0}, "nixl": {"device": "cpu"}, "naive": {}}[row]
    return {**base, "backend": row, "custom_backend_module": MODULE, "engine_kwargs": {row: kwargs}}, None


@dataclass
class RowResult:
    row: str
    note: str | None = None
    seconds: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    egress: list[list[float]] = field(default_factory=list)  # per refit, per trainer rank (backend's count)
    trainer: list[list[dict[str, Any]]] = field(default_factory=list)  # per refit, per trainer rank (Meter)
    receiver: list[list[dict[str, Any]]] = field(default_factory=list)  # per refit, per receiver (Meter)
    error: str | None = None


class Cluster:
    def __init__(self, trainers: int, rollouts: int, layout: Layout, ce: dict[str, Any]) -> None:
        from omegaconf import OmegaConf

        self.this = importlib.import_module(MODULE)  # workers' classes by reference (importable in every worker)
        # free_cache_engine: read by verl's naive (colocated) path; nothing to free on CPU
        config = OmegaConf.create({"actor": {"strategy": "fsdp"},
                                   "rollout": {"checkpoint_engine": ce, "free_cache_engine": False}})
        self.trainer_pool = vc.resource_pool(trainers)
        self.trainers = RayWorkerGroup(
            resource_pool=self.trainer_pool, device_name="cpu",
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(self.this.BenchTrainer), config=config,
                                                   role="actor", layout=layout.to_dict()))
        self.trainers.init_model()
        rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1,
                                       checkpoint_engine=CheckpointEngineConfig(**ce))
        self.rollout_pool = vc.resource_pool(rollouts)
        self.rollouts = RayWorkerGroup(
            resource_pool=self.rollout_pool, device_name="cpu",
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(self.this.BenchRollout),
                                                   rollout_config=rollout_config, layout=layout.to_dict()))
        self.replicas = [vc.Replica(replica_rank=r, config=rollout_config, model_config=None)
                         for r in range(rollouts)]
        for r, replica in enumerate(self.replicas):
            replica.workers = self.rollouts.workers[r:r + 1]
        self.manager: CheckpointEngineManager | None = None
        self.pids = [*self.trainers.pid(), *self.rollouts.pid()]

    def use(self, ce: dict[str, Any]) -> None:
        """Every worker's checkpoint engine anew from `ce`, and a manager for it (as verl builds one per trainer)."""
        self.trainers.reconfigure(ce)
        self.rollouts.reconfigure(ce)
        self.manager = CheckpointEngineManager(CheckpointEngineConfig(**ce), self.trainers, list(self.replicas))

    def refit(self, step: int, timeout: float) -> dict[str, Any]:
        """verl's update_weights (its auto_await runs the coroutine to completion), on a thread so that a refit that
        hangs (a backend waiting for a peer that never comes) ends the run after `timeout` s instead of never."""
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["metrics"] = self.manager.update_weights(global_steps=step)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                out["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            import signal

            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except OSError:
                    pass
            raise RefitTimeout(f"refit of step {step} still running after {timeout:.0f} s (workers' stacks: "
                               f"Ray's worker-*.err of this session)")
        if "error" in out:
            raise out["error"]
        return out.get("metrics") or {}

    def shutdown(self) -> None:
        for worker in [*self.trainers.workers, *self.rollouts.workers]:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for pool in (self.trainer_pool, self.rollout_pool):
            for pg in pool.get_placement_groups():
                ray.util.remove_placement_group(pg)


class RefitTimeout(Exception):
    """A refit overran --refit-timeout: the workers' stacks went to their stderr; the cluster is not reused."""


def run_row(cluster: Cluster, row: str, ce: dict[str, Any], note: str | None, refits: int, step: int,
            trainers: int, refit_timeout: float) -> tuple[RowResult, int]:
    result = RowResult(row, note)
    colocated = row == "naive"
    raise_after: RefitTimeout | None = None
    try:
        if colocated:
            cluster.trainers.colocate(True)
        cluster.use(ce)
        for k in range(refits + 1):
            step += 1
            cluster.trainers.train_step(step)
            cluster.trainers.meter_begin(k == 0)
            cluster.rollouts.meter_begin(k == 0)
            start = time.perf_counter()
            metrics = cluster.refit(step, refit_timeout) or {}
            seconds = time.perf_counter() - start
            trainer_meters = cluster.trainers.meter_end()
            receiver_meters = cluster.rollouts.meter_end()
            expected = cluster.trainers.expected()[0]
            served = cluster.trainers.colocated_served() if colocated else cluster.rollouts.served()
            correct = all(version == step and digests == expected for version, digests in served)
            if k == 0:
                if not correct:
                    result.error = "the warm-up refit landed wrong bytes"
                    break
                continue  # warm-up: set-up costs, plan compiles, first page faults
            result.seconds.append(seconds)
            result.correct.append(correct)
            result.egress.append([_egress(row, metrics, p) for p in range(trainers)])
            result.trainer.append(trainer_meters)
            result.receiver.append(trainer_meters if colocated else receiver_meters)
    except RefitTimeout as e:
        result.error = str(e)
        raise_after = e
    except Exception as e:  # noqa: BLE001 - reported in the table; the next row gets fresh engines
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        result.error = f"{type(e).__name__}: {' | '.join(lines[-3:])[-400:]}"  # a remote error's last lines say why
    finally:
        if colocated and raise_after is None:
            cluster.trainers.colocate(False)
    if raise_after is not None:
        raise RefitTimeout(result, step)
    return result, step


def _egress(row: str, metrics: dict[str, Any], rank: int) -> float:
    if row == "naive":
        return 0.0
    if row == "funnel":  # its trainer ranks other than 0 only drain, and return no metrics
        return float(metrics.get(f"funnel/trainer{rank}/egress_bytes", 0.0))
    prefix = "reshard" if row in RESHARD_ROWS else row
    return float(metrics.get(f"{prefix}/trainer{rank}/egress_bytes", float("nan")))


# --- report ------------------------------------------------------------------------------------------------------

MIB = 2 ** 20


def _mib(x: float) -> str:
    return "?" if x != x else f"{x / MIB:,.0f}"


def report(results: list[RowResult], model_bytes: int, bucket_mb: int, trainers: int, rollouts: int, copy_s: float,
           copy_after_s: float | None, gloo: list[float]) -> None:
    """The table: each row's refit time beside two ceilings of this run (memcpy: the host's copy bandwidth;
    gloo: what one TCP stream between two processes moves), both scaled to the bytes every receiver must get."""
    gloo_s = min(gloo) if gloo else float("nan")
    copy_s = min(copy_s, copy_after_s or copy_s)  # the faster of the two measurements: the generous ceiling
    print(f"\n{'row':<24} {'refit s: median (min-max)':<26} {'x memcpy':>8} {'x gloo':>6}  {'egress/trainer rank MiB':<24} "
          f"{'write() MiB/trainer':<20} {'peak/receiver MiB':>17}  verified")
    for r in results:
        receivers = trainers if r.row == "naive" else rollouts
        if r.error and not r.seconds:
            print(f"{r.row:<24} not measured: {r.error}")
            continue
        med = statistics.median(r.seconds)
        times = f"{med:.2f} ({min(r.seconds):.2f}-{max(r.seconds):.2f})"
        egress = ", ".join(_mib(max(e[p] for e in r.egress)) for p in range(len(r.egress[0])))
        wchar = ", ".join(_mib(max(t[p]["wchar"] for t in r.trainer)) for p in range(len(r.trainer[0])))
        peak = max(m["peak_growth"] for per in r.receiver for m in per)
        ok = "yes" if all(r.correct) else "WRONG"
        by_gloo = "-" if r.row == "naive" else f"{med / (receivers * gloo_s):.1f}x"
        print(f"{r.row:<24} {times:<26} {med / (receivers * copy_s):>7.1f}x {by_gloo:>6}  {egress:<24} {wchar:<20} "
              f"{_mib(peak):>17}  {sum(r.correct)}/{len(r.correct)} {ok}")
        if r.note or r.error:
            print(f"{'':<24} note: {r.note or ''}{' error after timed refits: ' + r.error if r.error else ''}")
    print(f"\nmodel {model_bytes / MIB:,.0f} MiB bf16; bucket {bucket_mb} MiB; receivers {rollouts} ({trainers} "
          f"colocated for naive). Ceilings, x the receivers: memcpy of the model by one thread {copy_s:.3f} s "
          f"({model_bytes / copy_s / 2**30:.2f} GiB/s; the faster of before the cluster and after it)"
          + f"; gloo send/recv of the model between two trainer processes "
          + ", ".join(f"{g:.3f} s" for g in gloo) + " (start, end of the run)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--layers", type=int, default=10, help="of Qwen3-1.7B's 28 (10: 2.1 GiB)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--refits", type=int, default=3, help="timed refits per row, after one warm-up")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--refit-timeout", type=float, default=900.0,
                        help="seconds one refit may take before the run stops (and the workers dump their stacks)")
    parser.add_argument("--json", help="write the raw figures here")
    args = parser.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` sends it: stop Ray, remove the file
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if "nixl" in rows and NIXL_UNAVAILABLE:
        print(f"nixl row skipped: {NIXL_UNAVAILABLE}")
        rows.remove("nixl")

    print("verl 0.9.1 stock backends on this host:")
    for name, registered, error, why in stock_report():
        print(f"  {name:<16} {'registered' if registered else 'not registered'}"
              f"{' (' + error + ')' if error else ''}; cannot run here: {why}")

    work = Path(tempfile.mkdtemp(prefix="verl-backends-"))
    (work / "config.json").write_text(json.dumps(model_config(args.layers, args.vocab)))
    shm = f"/dev/shm/verl-backends-{os.getpid()}.bin"
    results: list[RowResult] = []
    cluster: Cluster | None = None
    copy_after, copies, copies_after, gloo = None, {}, {}, []
    try:
        layout = make_weights(hf_tensors(work), shm)
        copies = copy_ceiling(shm)
        copy_s = min(copies.values())
        print(f"\nmodel: Qwen3 ({args.layers} layers, vocabulary {args.vocab}, hidden 2048, untied), "
              f"{len(layout.tensors)} tensors, {layout.model_bytes / MIB:,.0f} MiB bf16; {args.trainers} trainer "
              f"ranks -> {args.rollouts} rollout workers; bucket {args.bucket_mb} MiB; memcpy of the model "
              f"{copy_s:.3f} s ({', '.join(f'{k} {v:.3f} s' for k, v in copies.items())})")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXTRAS), os.environ.get("PYTHONPATH", "")) if p)
        vc.start_ray()
        first, _ = checkpoint_engine("funnel", str(work), args.bucket_mb)
        cluster = Cluster(args.trainers, args.rollouts, layout, first)
        gloo = [max(cluster.trainers.gloo_seconds())]
        print(f"gloo send/recv of the model between two trainer processes: {gloo[0]:.3f} s", flush=True)
        step = 0
        for row in rows:
            ce, note = checkpoint_engine(row, str(work), args.bucket_mb)
            print(f"running {row} ...", flush=True)
            try:
                result, step = run_row(cluster, row, ce, note, args.refits, step, args.trainers, args.refit_timeout)
            except RefitTimeout as e:  # the workers may be stuck in a transfer: measure nothing more on them
                result, step = e.args
                results.append(result)
                print(f"  {row}: {result.error}; the remaining rows are not run", flush=True)
                break
            results.append(result)
            if result.seconds:
                print(f"  {row}: {[round(s, 2) for s in result.seconds]} s, verified {result.correct}"
                      f"{', error: ' + result.error if result.error else ''}", flush=True)
            else:
                print(f"  {row}: {result.error}", flush=True)
        gloo.append(max(cluster.trainers.gloo_seconds()))
    finally:
        if cluster is not None:
            cluster.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        if results and os.path.exists(shm):
            copies_after = copy_ceiling(shm)
            copy_after = min(copies_after.values())
        if os.path.exists(shm):
            os.unlink(shm)
        shutil.rmtree(work, ignore_errors=True)
    report(results, layout.model_bytes, args.bucket_mb, args.trainers, args.rollouts, copy_s, copy_after, gloo)
    if results:
        method = next((m["method"] for r in results for per in r.receiver for m in per), None)
        print(f"peak memory measured by: {method}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model_bytes": layout.model_bytes, "layers": args.layers, "vocab": args.vocab,
            "bucket_mb": args.bucket_mb, "trainers": args.trainers, "rollouts": args.rollouts,
            "memcpy_seconds": copies, "memcpy_seconds_after": copies_after, "gloo_seconds": gloo,
            "stock": [dict(zip(("name", "registered", "import_error", "why"), s)) for s in stock_report()],
            "rows": [asdict(r) for r in results]}, indent=1))


if __name__ == "__main__":
    main()
