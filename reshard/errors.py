"""The library's own errors, with fields so callers can react without parsing messages.

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

InputError is not a ValueError: pydantic would wrap it into its ValidationError (`from_validation` unwraps).
"""
from __future__ import annotations

from typing import Any

_UNSET: Any = object()


def _listing(message: str, problems: tuple[str, ...], most: int) -> str:
    """`message` followed by the first `most` problems, one a line."""
    if not problems:
        return message
    more = f"\n  ... and {len(problems) - most} more" if len(problems) > most else ""
    return f"{message}:\n  - " + "\n  - ".join(problems[:most]) + more


def show(value: Any, width: int = 80) -> str:
    """A value as it reads in a message: its repr, cut to `width` characters (inputs may be huge or hostile)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile object's repr may raise anything
        text = f"<{type(value).__name__}>"
    return text if len(text) <= width else text[:width - 3] + "..."


class ReshardError(Exception):
    """Base class of every error reshard raises on purpose.

    `field`, `value` and `rule` name the input to blame, where one is (else None)."""

    field: str | None = None
    value: Any = None
    rule: str | None = None


class InputError(ReshardError):
    """An invalid input, named with the value received and the rule it breaks.

    `field` names it, `value` is what was received, `rule` the rule it breaks, `fix` what to do (where known)."""

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

    `field` is the key to blame, where one is (else a bare message)."""

    def __init__(self, message: str = "", *, field: str | None = None, value: Any = _UNSET, rule: str = "",
                 fix: str = "") -> None:
        if field is None:  # a bare message: nothing one field can be blamed for
            super().__init__(message, fix=fix)
            self.field, self.rule = None, None
        else:
            super().__init__(field, value, rule or message, fix, where="model config")


class LayoutError(InputError):
    """A layout that cannot exist.

    `constraint` names the broken rule, `values` what was received (the first is the `field` / `value` to blame)."""

    def __init__(self, layout: str, constraint: str, values: dict[str, Any] | None = None, fix: str = ""):
        super().__init__(constraint, fix=fix, where=layout)  # "layout: constraint (fix)"
        self.layout, self.constraint, self.values = layout, constraint, dict(values or {})
        first = next(iter(self.values.items()), (None, None))
        self.field, self.value, self.rule = first[0], first[1], constraint


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
        super().__init__(_listing(message, self.problems, 20))


class CoverageError(PlanError):
    """The plan does not write every destination element holding model data exactly once."""


class PlanFileError(PlanError):
    """A saved plan (a file or its dict) that is malformed, or whose content does not prove what it claims.

    `field` names the entry to blame (e.g. `arrays.t.rows`), where one is."""

    def __init__(self, message: str, problems: list[str] | tuple[str, ...] = (), *, field: str | None = None,
                 value: Any = None) -> None:
        super().__init__(message, problems)
        self.field, self.value, self.rule = field, value, message


class ExecutionError(ReshardError, RuntimeError):
    """A plan could not be executed; destinations keep their previous contents unless stated otherwise."""


class LayoutMismatchError(LayoutError):
    """A live model (a trainer's or an engine's) that does not match the declared layout.

    Raised before any byte moves; `problems` lists every difference found."""

    def __init__(self, layout: str, problems: list[str] | tuple[str, ...], fix: str = "",
                 where: str = "the live model"):
        self.where = where
        self.problems = tuple(problems)
        super().__init__(layout, _listing(f"{where} does not match the declared layout", self.problems, 30),
                         {"problems": self.problems}, fix)


class KernelFormatError(LayoutMismatchError):
    """Parameters that vLLM re-laid out (repacked, padded, swapped, quantized) after loading.

    Install through the model's weight loaders (loader mode), not in place."""


def from_validation(exc: Any, kind: str) -> ReshardError:
    """Our error for a pydantic ValidationError of a model spec (`kind` "model") or a layout (its kind): the library
    error a validator raised, else ModelConfigError / LayoutError naming the field, the value and pydantic's rule."""
    errors = exc.errors(include_url=False)
    for err in errors:
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ReshardError):
            return inner
    err = errors[0] if errors else {"loc": (), "msg": str(exc)}
    loc = [str(x) for x in err.get("loc", ())]
    rest = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errors[1:4])
    missing = err.get("type") == "missing"
    rule = "is required and missing" if missing else str(err.get("msg", "is invalid")).replace(
        "Input should be", "must be").replace("Value error, ", "")
    rule += f"; also {rest}" if rest else ""
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
    """The engine's log-probabilities differ from the trainer's beyond the thresholds after a refit (or an audit
    found perturbations that did not reach the engine); `report`: the MismatchReport or AuditReport."""

    def __init__(self, message: str, report: Any = None) -> None:
        self.report = report
        super().__init__(message)
