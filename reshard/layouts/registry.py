"""The registries: model families (by name and by HF architecture / model_type), layout classes (by engine name)
and the cuts an engine added later places a family's tensors with.

It imports nothing from the layouts when loaded (`register_family` reads ModelFamily when called), so the spec can
look a family up without a circle. Registration is explicit (`families.register_built_ins()`, `register_family`,
`register_layout`, `register_cuts`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ArgumentError, LayoutError, ModelConfigError
from .hf_config import read_hf_config

_BY_KEY: dict[str, Any] = {}   # HF architecture or model_type -> family
_BY_NAME: dict[str, Any] = {}  # ModelSpec.family -> family
# f(spec, entries, layer) -> entries: how a spec of another form lists a family's entries (layouts.fp8's wire
# specs list a quantized weight as fp8 + scales); registered by the modules that define those forms
_ENTRY_TRANSFORMS: list[Any] = []
_LAYOUTS: dict[str, Any] = {}  # engine name -> Layout class
_CUTS: dict[tuple[str, str], Any] = {}  # (engine, family) -> rule(spec, tensor kind) -> cuts


def register_layout(cls: Any) -> None:
    """Make a Layout class nameable by its `engine` (a refit destination where its `installs` is not empty).

    Args:
        cls: the Layout subclass; a later registration of the same engine replaces it.

    Raises:
        ArgumentError: `cls` has no engine name (its `engine` class attribute).
    """
    engine = getattr(cls, "engine", None)
    if not isinstance(engine, str) or not engine:
        raise ArgumentError("cls", cls, "must be a Layout class with an engine name (its `engine` class attribute)")
    _LAYOUTS[engine] = cls


def layout_class(engine: str) -> Any:
    """The Layout class registered for `engine`; LayoutError (listing those registered) where none is."""
    if not isinstance(engine, str) or engine not in _LAYOUTS:
        raise LayoutError(str(engine), f"unknown layout engine {engine!r}; expected one of {sorted(_LAYOUTS)}",
                          {"engine": engine})
    return _LAYOUTS[engine]


def registered_layouts() -> dict[str, Any]:
    """Every registered layout class, by engine name.

    Returns:
        A new dict: engine name -> Layout class.

    Raises:
        Nothing: it reads the registry.
    """
    return dict(_LAYOUTS)


def register_cuts(engine: str, family: str, rule: Any) -> None:
    """Say how `engine` places the tensors of `family` (an engine added after the families were written).

    Args:
        engine: the layout's engine name.
        family: the model family's name.
        rule: `rule(spec, kind)` returns the cuts of one TensorKind that declares none for `engine` itself; a later
            registration for the same pair replaces it.

    Raises:
        Nothing: the rule is stored as given.
    """
    _CUTS[(engine, family)] = rule


def engine_cuts(spec: Any, kind: Any, engine: str) -> tuple[Any, ...]:
    """The cuts that place tensors of `kind` on `engine`: the kind's own, else those `engine` registered for the
    model's family; LayoutError (naming engine, kind and the families it serves) where neither exists."""
    own = kind.cuts_for(engine)
    if own is not None:
        return own
    rule = _CUTS.get((engine, spec.family))
    if rule is None:
        served = sorted(f for e, f in _CUTS if e == engine)
        raise LayoutError(engine, f"{kind.label}: the {engine} engine has no cuts for the {spec.family} family's "
                          f"tensors (its kinds declare {[e for e, _ in kind.cuts]}; {engine} registered cuts for "
                          f"{served or 'no family'})", {"model.family": spec.family},
                          f"register the engine's cuts for {spec.family} (reshard.layouts.registry.register_cuts)")
    return tuple(rule(spec, kind))


def register_entry_transform(transform: Any) -> None:
    """Add `transform` to what every canonical table applies to its family's entries (once, in order)."""
    if transform not in _ENTRY_TRANSFORMS:
        _ENTRY_TRANSFORMS.append(transform)


def entry_transforms() -> tuple[Any, ...]:
    """What every canonical table applies to its family's entries, in order."""
    return tuple(_ENTRY_TRANSFORMS)


def register_family(cls: Any) -> Any:
    """Register the model family class `cls` (a ModelFamily subclass) and return it (usable as a decorator).

    Its one instance is findable by name, architectures and model types (replacing an earlier one).

    Args:
        cls: the family's class; it is instantiated once.

    Returns:
        `cls`, unchanged.

    Raises:
        ArgumentError: `cls` is not a concrete ModelFamily subclass.
    """
    from .family import ModelFamily  # the families import this module

    if not (isinstance(cls, type) and issubclass(cls, ModelFamily)) or getattr(cls, "__abstractmethods__", None):
        raise ArgumentError("cls", cls, "must be a concrete ModelFamily subclass (spec and layer defined)")
    family = cls()
    for key in family.architectures + family.model_types:
        _BY_KEY[key] = family
    _BY_NAME[family.name] = family
    return cls


def family(name: str) -> Any:
    """The family a ModelSpec names; ModelConfigError (listing those registered) where none is."""
    if name not in _BY_NAME:
        raise ModelConfigError(field="family", value=name, rule=f"is not registered (registered: "
                               f"{', '.join(sorted(_BY_NAME))})")
    return _BY_NAME[name]


def families() -> list[Any]:
    """Every registered family, by name."""
    return [_BY_NAME[n] for n in sorted(_BY_NAME)]


def registered_families() -> list[str]:
    """The names of the registered families (`ModelSpec.family`).

    Returns:
        The names, sorted.

    Raises:
        Nothing: it reads the registry.
    """
    return sorted(_BY_NAME)


def supported_architectures() -> list[str]:
    """The HF architectures (`architectures` of a config.json) some registered family reads.

    Returns:
        The class names, sorted.

    Raises:
        Nothing: it reads the registry.
    """
    return sorted(k for k in _BY_KEY if k[:1].isupper())


def discover(config: "dict[str, Any] | str | Path") -> Any:
    """The family of an HF config, by `architectures` first, then `model_type`.

    Args:
        config: as `read_hf_config` takes it.

    Returns:
        The registered ModelFamily.

    Raises:
        ModelConfigError: an unreadable config, or an architecture and model_type no family reads.
    """
    config = read_hf_config(config)
    archs = config.get("architectures") or []
    model_type = config.get("model_type", "")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelConfigError(field="architectures", value=archs, rule="must be a JSON list of class names")
    if not isinstance(model_type, str):
        raise ModelConfigError(field="model_type", value=model_type, rule="must be a JSON string")
    for key in archs + [model_type]:
        if key in _BY_KEY:
            return _BY_KEY[key]
    raise ModelConfigError(field="architectures", value=archs,
                           rule=f"unknown architecture (model_type={model_type!r}); supported: "
                                f"{', '.join(supported_architectures())}")


def spec_from_hf_config(config: "dict[str, Any] | str | Path", include_mtp: bool = False) -> Any:
    """Build a ModelSpec from an HF config (`ModelSpec.from_hf_config` also keeps the config's math).

    Args:
        config: as `read_hf_config` takes it.
        include_mtp: ask for the multi-token-prediction layers too (refused where the config has any).

    Returns:
        The family's ModelSpec of the config.

    Raises:
        ArgumentError: `include_mtp` is not a bool.
        ModelConfigError: an unreadable or unknown config, a field of the wrong type or breaking a rule, or
            multi-token-prediction layers asked for.
        LimitError: a size beyond `reshard.limits`.
    """
    if not isinstance(include_mtp, bool):
        raise ArgumentError("include_mtp", include_mtp, "must be True or False")
    config = read_hf_config(config)
    return discover(config).spec(config, include_mtp=include_mtp)
