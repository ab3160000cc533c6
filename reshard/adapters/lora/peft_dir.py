"""Landing (b): a LoRA refit written as a PEFT adapter directory that vLLM (or PEFT) loads with its own loader,
published atomically: the served path is a symbolic link switched by rename(2) to each version's new directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from ...errors import ArgumentError, ExecutionError
from ...executors.reference import allocate
from ...layouts.lora import PeftLayout, peft_config

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
_VERSION = re.compile(r"[A-Za-z0-9._-]{1,64}")


class PeftDirectory:
    """The PEFT directory `path` (a symbolic link to the published version) of the adapter `layout` describes."""

    def __init__(self, path: str | Path, layout: PeftLayout, base_model: str = "") -> None:
        if not isinstance(layout, PeftLayout):
            raise ArgumentError("layout", type(layout).__name__, "must be a PeftLayout")
        self.path, self.layout, self.base_model = Path(path), layout, base_model
        if self.path.exists() and not self.path.is_symlink():
            raise ArgumentError("path", str(self.path), "exists and is not a link this writer made",
                                fix="give a new path; publish makes it a link to each version's directory")
        self.tensors: dict[str, torch.Tensor] = allocate(layout, ranks=[0])[0]  # where a refit lands

    def publish(self, version: str) -> Path:
        """Write the refit's tensors as version `version` and switch the served path to it; returns the version's
        directory."""
        from safetensors.torch import save_file

        if not isinstance(version, str) or not _VERSION.fullmatch(version):
            raise ArgumentError("version", version, "must be 1-64 characters of [A-Za-z0-9._-]")
        want = self.layout.rank_tensors(0)
        bad = [n for n, s in want.items() if n not in self.tensors or tuple(self.tensors[n].shape) != s]
        if bad or len(self.tensors) != len(want):
            raise ExecutionError(f"the tensors to publish do not match {self.layout}: {bad[:3]}")
        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True)
        target = parent / f".{self.path.name}.{version}.{uuid.uuid4().hex[:8]}"
        tmp = parent / f".{target.name}.writing"
        tmp.mkdir()
        try:
            save_file({n: t.contiguous() for n, t in self.tensors.items()}, str(tmp / WEIGHTS),
                      metadata={"format": "pt", "reshard_version": version})
            (tmp / CONFIG).write_text(json.dumps(peft_config(self.layout.model, self.base_model), indent=2))
            for f in (WEIGHTS, CONFIG):
                _fsync(tmp / f)
            tmp.rename(target)
            link = parent / f".{self.path.name}.link.{uuid.uuid4().hex[:8]}"
            link.symlink_to(target.name)
            previous = self.current()
            os.replace(link, self.path)  # the switch: one rename
            _fsync(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        return target

    def current(self) -> Path | None:
        """The directory the served path points at now (None before the first publish)."""
        return self.path.parent / os.readlink(self.path) if self.path.is_symlink() else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
