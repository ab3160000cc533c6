"""The library's own errors. Each carries fields so callers can react without parsing messages."""
from __future__ import annotations

from typing import Any


class ReshardError(Exception):
    """Base class of every error reshard raises on purpose."""


class LayoutError(ReshardError):
    """A layout that cannot exist: `constraint` names the broken rule, `values` what was received.

    Not a ValueError on purpose: pydantic would wrap a ValueError raised in a validator into its own
    ValidationError, and callers should get this class.
    """

    def __init__(self, layout: str, constraint: str, values: dict[str, Any] | None = None, fix: str = ""):
        self.layout = layout
        self.constraint = constraint
        self.values = dict(values or {})
        self.fix = fix
        message = f"{layout}: {constraint}"
        if fix:
            message += f" ({fix})"
        super().__init__(message)


class ModelConfigError(ReshardError):
    """An HF config that reshard cannot turn into a model spec."""


class PlanError(ReshardError, ValueError):
    """A plan that cannot be compiled, loaded or executed; `problems` lists every problem found."""

    def __init__(self, message: str, problems: list[str] | tuple[str, ...] = ()):
        self.problems = tuple(problems)
        full = message
        if self.problems:
            shown = "\n  - ".join(self.problems[:20])
            more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
            full = f"{message}:\n  - {shown}{more}"
        super().__init__(full)


class CoverageError(PlanError):
    """The plan does not write every destination element holding model data exactly once."""


class ExecutionError(ReshardError, RuntimeError):
    """A plan could not be executed; destinations keep their previous contents unless stated otherwise."""


class LayoutMismatchError(LayoutError):
    """A live model (a Megatron trainer's or a vLLM engine's) does not match the declared layout: it does not hold
    the tensors the layout says, or its weight loaders place bytes elsewhere. Raised before any byte moves;
    `problems` lists every difference found (tensor names and both shapes, parallel sizes, ...)."""

    def __init__(self, layout: str, problems: list[str] | tuple[str, ...], fix: str = "",
                 where: str = "the live model"):
        self.where = where
        self.problems = tuple(problems)
        shown = "\n  - ".join(self.problems[:30])
        more = f"\n  ... and {len(self.problems) - 30} more" if len(self.problems) > 30 else ""
        super().__init__(layout, f"{where} does not match the declared layout:\n  - {shown}{more}",
                         {"problems": self.problems}, fix)


class KernelFormatError(LayoutMismatchError):
    """Parameters that vLLM re-laid out (repacked, padded, swapped, quantized) after loading: writing them in
    place would corrupt the model. Install through the model's weight loaders instead (loader mode)."""
