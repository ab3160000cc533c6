"""An HF checkpoint directory as a refit destination engine: the weights land as sharded safetensors files
(`model-0000k-of-0000W.safetensors`, one per writer, + index + `config.json`) that transformers reads.

Made of registrations only: `HfDirectoryLayout` (engine "hf_dir", install "direct": layer i on writer i * W // L,
the rest on writer 0), its cuts (every tensor kind whole under its HF name), and `HfDirectoryEngine`, an
`EngineClient` whose finish writes the directory (to a sibling renamed over it: a reader never sees a part).
Its writers live in its process, so it takes the in-process transports ("inprocess", "colocated").

    refit = RefitSpec.of(spec, MegatronLayout(model=spec, tp=2, pp=2), HfDirectoryLayout(model=spec, writers=4),
                         transport="inprocess")
    TrainerSession(refit, 0, shards, engines=[HfDirectoryEngine("ckpt/", config)]).init()
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import StrictInt, model_validator

from ..errors import ExecutionError, LayoutError
from ..layouts import ModelSpec, register_cuts, register_layout, registered_families
from ..layouts.base import WholePerReplica, bounded, positive
from ..layouts.cut_layout import CutLayout, Where
from ..layouts.cuts import Cut, Group, Replicated, TensorKind
from ..layouts.roles import kind_of
from ..limits import MAX_RANKS
from .engines import EngineClient

ENGINE = "hf_dir"


class HfDirectoryLayout(WholePerReplica, CutLayout):
    """An HF checkpoint directory written by `writers` ranks, one safetensors file each.

    Args:
        model: the model written.
        writers: ranks of one directory, each writing the file of its layers (at most one per layer).
        replicas: directories (replica k's writer w is rank k * writers + w).

    Raises:
        LayoutError: a count that is not positive, or more writers than layers.
        LimitError: a count beyond `reshard.limits`.
    """

    engine = ENGINE
    installs = ("direct",)

    writers: StrictInt = 1
    replicas: StrictInt = 1

    @model_validator(mode="after")
    def _validate(self) -> "HfDirectoryLayout":
        self._check_replicas()
        positive(self, writers=self.writers)
        bounded(self, MAX_RANKS, "ranks", **{"writers * replicas": self.writers * self.replicas})
        if self.writers > max(self.model.num_layers, 1):
            self._fail(f"writers={self.writers} exceeds the model's {self.model.num_layers} layers (a writer "
                       f"writes the file of its layers)", "use at most one writer per layer", writers=self.writers)
        self._check_cuts()
        return self

    @property
    def num_ranks(self) -> int:
        return self.writers * self.replicas

    def __str__(self) -> str:
        return f"{ENGINE}:writers={self.writers},replicas={self.replicas}"

    def file_name(self, writer: int) -> str:
        """The safetensors file writer `writer` writes."""
        return f"model-{writer + 1:05d}-of-{self.writers:05d}.safetensors"

    def _place(self, cut: Cut, kind: TensorKind, layer: np.ndarray | int, expert: np.ndarray | int,
               replica: int | None) -> Where:
        copies = tuple(k * self.writers for k in (range(self.replicas) if replica is None else (replica,)))
        first = np.where(np.asarray(layer) < 0, 0, np.asarray(layer) * self.writers // max(self.model.num_layers, 1))
        return Where(Group(ENGINE, 1, 1, copies), first if np.ndim(first) else int(first), (layer, expert),
                     lambda i, e: cut.name.format(i=i, e=e))


@functools.lru_cache(maxsize=256)
def hf_names(spec: ModelSpec, kind: TensorKind) -> tuple[Cut, ...]:
    """The HF directory's cut of `kind`: whole, under its family's one name for it (a kind named twice is refused)."""
    names = sorted({e.name for e in spec.canonical.entries if kind_of(spec, e.role) == kind})
    if len(names) != 1:
        raise LayoutError(ENGINE, f"{kind.label}: the {spec.family} family names it {names or 'nowhere'}; an HF "
                          f"directory places a tensor kind under one name", {"model.family": spec.family})
    return (Replicated(names[0]),)


class HfDirectoryEngine(EngineClient):
    """An HF checkpoint directory as an engine a `TrainerSession` refits.

    Args:
        path: the directory (replaced as a whole at each refit's finish).
        config: the model's HF config (written as config.json).

    Raises:
        ExecutionError: from the refit calls: a destination that is not an HF directory, a cross-process
            transport, or a call out of order.
        PlanError: at init, a plan other than the trainer's.
    """

    def __init__(self, path: str | Path, config: dict[str, Any]) -> None:
        self.path, self.config = Path(path), dict(config)
        self.refit: Any = None
        self.executor: Any = None
        self.tensors: dict[int, dict[str, Any]] = {}
        self.version: str | None = None  # of the checkpoint on disk
        self._open = False

    def __repr__(self) -> str:
        return f"HfDirectoryEngine({self.path})"

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from ..executors import allocate
        from .refit import RefitSpec, open_transport

        refit = RefitSpec.from_dict(init_info)
        _, dst = refit.layouts()
        if not isinstance(dst, HfDirectoryLayout):
            raise ExecutionError(f"{self}: the refit's destination is {dst}, not an {ENGINE} layout")
        refit.agreed_plan(str(self))
        if refit.cross_process:
            raise ExecutionError(f"{self}: its writers live in this process; transport {refit.transport!r} needs "
                                 f"a process per writer (use 'inprocess' or 'colocated')")
        self.close()
        ranks = [refit.replica * dst.writers + w for w in range(dst.writers)]
        self.refit, self.tensors = refit, allocate(dst, ranks=ranks)
        self.executor = open_transport(refit, 0, {}, self.tensors)

    def start_weight_update(self) -> None:
        if self.executor is None:
            raise ExecutionError(f"{self}: start_weight_update before init_weight_transfer_engine")
        self._open = True

    def update_weights(self, update_info: Any) -> None:
        if not self._open:
            raise ExecutionError(f"{self}: update_weights outside an update (start_weight_update first)")
        if (update_info or {}).get("phase", "transfer") == "transfer":
            self.executor.refit()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Write the directory with `weight_version`; None ends a failed update and writes nothing."""
        if not self._open:
            raise ExecutionError(f"{self}: no update is open")
        self._open = False
        if weight_version is None:
            return
        from safetensors.torch import save_file

        version, (_, dst) = str(weight_version), self.refit.layouts()
        staging = self.path.with_name(f".{self.path.name}.writing")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        weight_map, total = {}, 0
        for w, rank in enumerate(sorted(self.tensors)):
            tensors = self.tensors[rank]
            save_file(tensors, str(staging / dst.file_name(w)), metadata={"format": "pt", "version": version})
            weight_map.update({name: dst.file_name(w) for name in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total, "weight_version": version},
                 "weight_map": dict(sorted(weight_map.items()))}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (staging / "config.json").write_text(json.dumps(self.config, indent=2))
        old = self.path.with_name(f".{self.path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if self.path.exists():
            os.replace(self.path, old)
        os.replace(staging, self.path)
        shutil.rmtree(old, ignore_errors=True)
        self.version = version

    def close(self) -> None:
        """Close the transport (the directory stays)."""
        if self.executor is not None:
            self.executor.close()
        self.executor, self._open = None, False


register_layout(HfDirectoryLayout)
for _family in registered_families():
    if _family != "lora":  # an adapter's names are PEFT's, not a checkpoint's
        register_cuts(ENGINE, _family, hf_names)

__all__ = ["ENGINE", "HfDirectoryEngine", "HfDirectoryLayout", "hf_names"]
