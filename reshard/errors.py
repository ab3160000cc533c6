"""The library's own errors. Each carries fields so callers can react without parsing messages.

    ReshardError                    everything reshard raises on purpose
    ├── InputError                  an input that is not valid: `field`, `value`, `rule` (and `fix`)
    │   ├── ModelConfigError        an HF config or model spec
    │   ├── LayoutError             a layout (constructor, string, dict)
    │   │   └── LayoutMismatchError a live model that differs from its declared layout
    │   │       └── KernelFormatError
    │   ├── ArgumentError           an argument of a function or a command-line flag
    │   └── LimitError              a size or count no real model or cluster has (`limit` says the bound)
    ├── PlanError                   a plan that cannot be compiled, loaded or run (`problems`)
    │   ├── CoverageError           a plan that does not write every destination element exactly once
    │   └── PlanFileError           a saved plan that is malformed or does not prove what it claims
    ├── ExecutionError              a refit that could not run (faults, and tensors an executor refuses)
    └── MismatchError               the engine computes other log-probabilities than the trainer (reshard.verify)

InputError is not a ValueError on purpose: pydantic wraps a ValueError raised in a validator into its own
ValidationError, and callers should get these classes (`from_validation` turns pydantic's into ours).
"""
from __future__ import annotations

from typing import Any

_UNSET: Any = object()


def show(value: Any, width: int = 80) -> str:
    """A value as it reads in a message: its repr, cut to `width` characters (inputs may be huge or hostile)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile object's repr may raise anything
        text = f"<{type(value).__name__}>"
    return text if len(text) <= width else text[:width - 3] + "..."


class ReshardError(Exception):
    """Base class of every error reshard raises on purpose.

    `field`, `value` and `rule` are set where one input is to blame (None otherwise).
    """

    field: str | None = None
    value: Any = None
    rule: str | None = None


class InputError(ReshardError):
    """An invalid input, named with the value received and the rule it breaks.

    `field` names it (a config key, an argument, a layout option, a plan file entry), `value` is what was
    received and `rule` the rule it breaks; `fix` says what to do, where it is known.
    """

    def __init__(self, field: str, value: Any = _UNSET, rule: str = "", fix: str = "", where: str = "") -> None:
        self.field, self.rule, self.fix = field, rule, fix
        self.value = None if value is _UNSET else value
        text = field if value is _UNSET else f"{field}={show(value)}"
        message = f"{where}: {text}" if where else text
        if rule:
            message += f" {rule}"
        if fix:
            message += f" ({fix})"
        super().__init__(message)


class ModelConfigError(InputError):
    """An HF config or a model spec that reshard cannot turn into a model.

    `field` is the config key (or spec field) to blame when one is. Raised with a bare message where no single
    key is.
    """

    def __init__(self, message: str = "", *, field: str | None = None, value: Any = _UNSET, rule: str = "",
                 fix: str = "") -> None:
        if field is None:
            ReshardError.__init__(self, message)
            self.field, self.value, self.rule, self.fix = None, None, None, fix
            return
        super().__init__(field, value, rule or message, fix, where="model config")


class LayoutError(InputError):
    """A layout that cannot exist.

    `constraint` names the broken rule, `values` what was received (the first of them is the `field` / `value`
    to blame).
    """

    def __init__(self, layout: str, constraint: str, values: dict[str, Any] | None = None, fix: str = ""):
        self.layout = layout
        self.constraint = constraint
        self.values = dict(values or {})
        self.fix = fix
        first = next(iter(self.values.items()), (None, None))
        self.field, self.value, self.rule = first[0], first[1], constraint
        message = f"{layout}: {constraint}"
        if fix:
            message += f" ({fix})"
        ReshardError.__init__(self, message)


class ArgumentError(InputError):
    """A bad argument of a function, or a bad command-line flag (`field` is its name, e.g. `--layers`)."""


class LimitError(InputError):
    """A size or count larger than any real model or cluster (`limit`): refused before anything is allocated."""

    def __init__(self, field: str, value: Any, limit: int, what: str, where: str = "") -> None:
        self.limit = limit
        super().__init__(field, value, f"exceeds the limit of {limit:,} on {what}", where=where)


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


class PlanFileError(PlanError):
    """A saved plan (a file or its dict) that is malformed, or whose content does not prove what it claims.

    `field` names the entry to blame (e.g. `arrays.t.rows`, `digest`) when one is.
    """

    def __init__(self, message: str, problems: list[str] | tuple[str, ...] = (), *, field: str | None = None,
                 value: Any = None) -> None:
        super().__init__(message, problems)
        self.field, self.value, self.rule = field, value, message


class ExecutionError(ReshardError, RuntimeError):
    """A plan could not be executed; destinations keep their previous contents unless stated otherwise."""


class LayoutMismatchError(LayoutError):
    """A live model (a Megatron trainer's or a vLLM engine's) that does not match the declared layout.

    It does not hold the tensors the layout says, or its weight loaders place bytes elsewhere. Raised before any
    byte moves; `problems` lists every difference found (tensor names and both shapes, parallel sizes, ...).
    """

    def __init__(self, layout: str, problems: list[str] | tuple[str, ...], fix: str = "",
                 where: str = "the live model"):
        self.where = where
        self.problems = tuple(problems)
        shown = "\n  - ".join(self.problems[:30])
        more = f"\n  ... and {len(self.problems) - 30} more" if len(self.problems) > 30 else ""
        super().__init__(layout, f"{where} does not match the declared layout:\n  - {shown}{more}",
                         {"problems": self.problems}, fix)


class KernelFormatError(LayoutMismatchError):
    """Parameters that vLLM re-laid out (repacked, padded, swapped, quantized) after loading.

    Writing them in place would corrupt the model: install through the model's weight loaders instead (loader
    mode).
    """


def from_validation(exc: Any, kind: str) -> ReshardError:
    """Our error for a pydantic ValidationError of a model spec (`kind` "model") or a layout (its kind): the
    library error a validator raised, if one did; else every field error, naming the field, the value received
    and pydantic's rule (the spec's fields blame ModelConfigError, a layout's LayoutError)."""
    errors = exc.errors(include_url=False)
    for err in errors:
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ReshardError):
            return inner
    err = errors[0] if errors else {"loc": (), "msg": str(exc)}
    loc = [str(x) for x in err.get("loc", ())]
    rest = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errors[1:4])
    rule = str(err.get("msg", "is invalid")).replace("Input should be", "must be").replace(
        "Value error, ", "") + (f"; also {rest}" if rest else "")
    missing = err.get("type") == "missing"
    if missing:
        rule = "is required and missing" + (f"; also {rest}" if rest else "")
    if kind == "model" or (loc and loc[0] == "model"):
        field = ".".join(loc[1:] if loc and loc[0] == "model" and kind != "model" else loc) or "model"
        return ModelConfigError(field=field, value=_UNSET if missing else err.get("input"), rule=rule)
    field = ".".join(loc) or kind
    text = field if missing else f"{field}={show(err.get('input'))}"
    return LayoutError(kind, f"{text} {rule}", {field: None if missing else err.get("input")})


__all__ = ["ArgumentError", "CoverageError", "ExecutionError", "InputError", "KernelFormatError", "LayoutError",
           "LayoutMismatchError", "LimitError", "ModelConfigError", "PlanError", "PlanFileError", "ReshardError",
           "from_validation", "show"]


class MismatchError(ReshardError):
    """The engine's token log-probabilities differ from the trainer's beyond the thresholds after a refit (or a
    slice-sensitivity audit found tensors whose perturbation did not reach the engine as it reached the trainer):
    `report` holds the measurement (reshard.verify.MismatchReport or AuditReport)."""

    def __init__(self, message: str, report: Any = None) -> None:
        self.report = report
        super().__init__(message)
