"""FP8 block-scaled destinations as data: which canonical tensors an FP8 engine keeps quantized, their scales, and
where their cuts put blocks.

An HF FP8 checkpoint (`quant_method: fp8` with `weight_block_size`) stores each linear weight W [N, K] as
float8_e4m3fn plus float32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]; non-linear tensors and the ignored modules
stay in the model's dtype; vLLM's Fp8 methods hold the same per rank. `wire_spec(spec, scheme, receiver)` is the
model a quantizing refit plans over: each quantized tensor becomes fp8 plus a scale whose cuts are the weight's
divided by the block (`ScaledCut`, which refuses a cut that splits a block); one listed in `receiver` travels in
the model's dtype into a staging tensor `<vLLM name>.bf16`, quantized on the receiving rank. The facts ride in
the spec's `arch` under "fp8", so specs, layouts and plans serialize as before."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Hashable, Iterable

from pydantic import ConfigDict, StrictInt, StrictStr, model_validator

from ..errors import LayoutError, ModelConfigError
from .cuts import Cut, Group, Piece, Shape, TensorKind
from .hf_config import read_hf_config
from . import registry
from .model import Entry, Experts, ModelSpec, Role, entry_lists
from .roles import kind_of
from .validated import ValidatedModel

FP8 = "float8_e4m3fn"
SCALE_DTYPE = "float32"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4  # DeepGEMM's / vLLM's floor on a block's amax: an all-zero block gets scale 1e-4 / 448
STAGING = ".bf16"  # suffix of a receiver's staging tensor (named after the vLLM parameter it becomes)
ARCH_KEY = "fp8"

# The shared roles vLLM builds as linear layers (LinearBase / RoutedExperts / GateLinear): Fp8Config quantizes
# them unless ignored. Embeddings, lm_head (a vocab embedding) and norms are not linear layers.
LINEAR_ROLES = frozenset({Role.Q, Role.K, Role.V, Role.O, Role.GATE, Role.UP, Role.DOWN, Role.ROUTER,
                          Role.EXPERT_GATE, Role.EXPERT_UP, Role.EXPERT_DOWN})


class Fp8Scheme(ValidatedModel):
    """An FP8 block-scaled destination: block (rows, cols), the activation scheme and the modules left in high
    precision (HF module names, matched as vLLM's Fp8Config matches them: exactly, experts by substring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block: tuple[StrictInt, StrictInt] = (128, 128)
    activation_scheme: StrictStr = "dynamic"
    ignored: tuple[StrictStr, ...] = ()
    fmt: StrictStr = "e4m3"

    error_where: ClassVar[str] = "quantization_config"

    @model_validator(mode="after")
    def _supported(self) -> "Fp8Scheme":
        for field, value, bad, rule in (
                ("weight_block_size", list(self.block), any(b < 1 or b > 1 << 16 for b in self.block),
                 "must be two positive block sizes (rows, cols)"),
                ("activation_scheme", self.activation_scheme, self.activation_scheme != "dynamic",
                 "must be 'dynamic' for block-scaled FP8 (vLLM's Fp8Config refuses others)"),
                ("fmt", self.fmt, self.fmt != "e4m3", "must be 'e4m3' (float8_e4m3fn)")):
            if bad:
                raise ModelConfigError(field="quantization_config." + field, value=value, rule=rule)
        return self

    @classmethod
    def from_hf_config(cls, config: "dict[str, Any] | str") -> "Fp8Scheme":
        """The scheme of an HF config.json (or its dict, or a checkpoint directory) `quantization_config`."""
        q = read_hf_config(config).get("quantization_config")
        if not isinstance(q, dict):
            raise ModelConfigError(field="quantization_config", value=q, rule="is missing: not an FP8 checkpoint "
                                   "config", fix='add {"quant_method": "fp8", "weight_block_size": [128, 128]}')
        return cls.from_quantization_config(q)

    @classmethod
    def from_quantization_config(cls, q: dict[str, Any]) -> "Fp8Scheme":
        """The scheme an HF `quantization_config` declares; ModelConfigError where it is not block-scaled FP8."""
        if q.get("quant_method") != "fp8":
            raise ModelConfigError(field="quantization_config.quant_method", value=q.get("quant_method"),
                                   rule="must be 'fp8'")
        block = q.get("weight_block_size")
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise ModelConfigError(field="quantization_config.weight_block_size", value=block,
                                   rule="must be [rows, cols] (per-tensor FP8 has no block scales: not supported)")
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or ()  # vLLM's order of precedence
        if not isinstance(ignored, (list, tuple)) or not all(isinstance(x, str) for x in ignored):
            raise ModelConfigError(field="quantization_config.modules_to_not_convert", value=ignored,
                                   rule="must be a list of module names")
        return cls(block=tuple(block), activation_scheme=q.get("activation_scheme", "dynamic"),
                   ignored=tuple(ignored), fmt=q.get("fmt", "e4m3"))

    def to_quantization_config(self) -> dict[str, Any]:
        """The HF `quantization_config` of this scheme (what an FP8 checkpoint of it declares)."""
        return {"quant_method": "fp8", "weight_block_size": list(self.block), "activation_scheme":
                self.activation_scheme, "fmt": self.fmt, **({"ignored_layers": list(self.ignored)}
                                                            if self.ignored else {})}

    def check_engine(self, config: "dict[str, Any] | str") -> None:
        """Refuse an engine whose HF config (or `quantization_config`) quantizes otherwise than this scheme."""
        cfg = config if isinstance(config, dict) and "quant_method" in config else read_hf_config(config)
        q = cfg if "quant_method" in cfg else cfg.get("quantization_config")
        if not isinstance(q, dict):
            raise ModelConfigError(field="quantization_config", value=q, rule="is missing from the engine's config: "
                                   "the engine is not an FP8 engine", fix="refit it without an FP8 destination")
        engine = Fp8Scheme.from_quantization_config(q)
        if engine.block != self.block:
            raise ModelConfigError(field="quantization_config.weight_block_size", value=list(engine.block),
                                   rule=f"the engine uses {list(engine.block)} blocks, the destination declares "
                                   f"{list(self.block)}", fix="declare the engine's block size")
        mine, theirs = set(self.ignored), set(engine.ignored)
        only_e, only_d = sorted(theirs - mine), sorted(mine - theirs)
        if only_e or only_d:
            raise ModelConfigError(field="quantization_config.modules_to_not_convert", value=only_e[:5] or only_d[:5],
                                   rule=f"the engine and the destination disagree on the modules left unquantized "
                                   f"(only the engine's: {only_e[:5]}; only the declared: {only_d[:5]})",
                                   fix="declare the engine's ignored modules")

    def is_ignored(self, tensor_name: str) -> bool:
        """Whether the module holding HF tensor `tensor_name` is left unquantized (vLLM's Fp8Config matching rule)."""
        module = tensor_name.rsplit(".", 1)[0]
        if module in self.ignored:
            return True
        if ".experts." in module:
            moe = module.split(".experts.")[0] + ".experts"
            return any(moe in x for x in self.ignored if "experts" in x)
        return False


def scale_name(name: str) -> str:
    """The scale tensor of weight `name` (HF, vLLM and the sender's shadow alike): `...weight_scale_inv`."""
    if not name.endswith("weight") and "weight{j}" not in name:
        raise LayoutError("fp8", f"{name!r} is not a weight: it has no block scale", {"tensor": name})
    return name.replace("weight{j}", "weight_scale_inv{j}") if "weight{j}" in name else name + "_scale_inv"


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


@dataclass(frozen=True)
class ScaledCut(Cut):
    """The scales of a weight cut by `inner`: every piece of the weight divided by the block, so the scale of
    block (i, j) sits where the weight's block (i, j) sits. A piece that starts or ends inside a block (other than
    at the tensor's edge) splits a block between ranks or slots: refused, naming tensor, dim and block."""

    inner: Cut = field(default=None, kw_only=True)  # type: ignore[assignment]
    weight_shape: Shape = field(default=(), kw_only=True)
    block: tuple[int, int] = field(default=(128, 128), kw_only=True)

    def pieces(self, what: str, shape: Shape, g: Group) -> tuple[Shape, list[Piece]]:
        phys, pieces = self.inner.pieces(what, self.weight_shape, g)
        b = self.block
        out = []
        for r, c, n, p in pieces:
            for d in (0, 1):
                end = c[d] + n[d]
                if c[d] % b[d] or p[d] % b[d] or (end % b[d] and end != self.weight_shape[d]):
                    first = (c[d] // b[d]) if c[d] % b[d] else (end // b[d])
                    raise LayoutError(g.side, f"{what}: the {g.side} cut {self.inner.name!r} with tp={g.tp} puts "
                                      f"rows/cols [{c[d]}, {end}) of dim {d} on rank {r} (at {p[d]} there): it "
                                      f"splits {b[0]}x{b[1]} block {first} of dim {d}", {"tensor": what, "dim": d,
                                                                                          "block": first, "tp": g.tp})
            out.append((r, tuple(x // bb for x, bb in zip(c, b)),
                        tuple(_blocks(x, bb) for x, bb in zip(n, b)) if min(n) else tuple(n),
                        tuple(x // bb for x, bb in zip(p, b))))
        return tuple(_blocks(x, bb) for x, bb in zip(phys, b)), out


def scale_kind(kind: TensorKind, shape: Shape, block: tuple[int, int]) -> TensorKind:
    """The TensorKind of the scales of a weight of `kind` and `shape`: every engine's cuts scaled by the block."""
    def scaled(cuts: tuple[Cut, ...]) -> tuple[Cut, ...]:
        return tuple(ScaledCut(scale_name(c.name), at=c.at, moe_name=c.moe_name and scale_name(c.moe_name),
                               inner=c, weight_shape=shape, block=block) for c in cuts)
    return TensorKind(kind.label + "_scale", {engine: scaled(cuts) for engine, cuts in kind.cuts}, expert=kind.expert)


def staged_kind(kind: TensorKind) -> TensorKind:
    """A receiver-quantized tensor's TensorKind: on vLLM it lands in the staging tensor named after the parameter."""
    staged = tuple(replace(c, name=c.name + STAGING) for c in kind.cuts_for("vllm") or ())
    return replace(kind.with_cuts(vllm=staged), label=kind.label + STAGING)


def is_quantized(spec: ModelSpec, scheme: Fp8Scheme, e: Entry, layer: int) -> bool:
    """Whether an FP8 engine of `scheme` keeps entry `e` of `layer` (-1: outside the layers) in fp8."""
    role, name = e.role, e.name.format(i=max(layer, 0), e=0)
    linear = role in LINEAR_ROLES if isinstance(role, Role) else bool(getattr(role, "linear", False))
    if role == Role.ROUTER:
        linear = registry.family(spec.family).fp8_router
    return e.dtype is None and linear and len(e.shape) == 2 and name.endswith(".weight") \
        and not scheme.is_ignored(name)


def wire_spec(spec: ModelSpec, scheme: Fp8Scheme, receiver: Iterable[str] = ()) -> ModelSpec:
    """`spec` as a quantizing refit plans it: quantized tensors as fp8 + scales, `receiver`'s into staging tensors."""
    if spec.arch_value(ARCH_KEY) is not None:
        raise ModelConfigError(field="arch.fp8", value=spec.arch_value(ARCH_KEY), rule="is set: the spec is "
                               "already an FP8 wire spec", fix="pass the model's own spec")
    if spec.dtype == FP8:
        raise ModelConfigError(field="dtype", value=spec.dtype, rule="the source model is already float8: an FP8 "
                               "source with its own blocks is not re-quantized", fix="refit from the bf16 weights")
    info = {"block": list(scheme.block), "ignored": list(scheme.ignored), "receiver": sorted(set(receiver)),
            "activation_scheme": scheme.activation_scheme}
    return ModelSpec(**{**spec.model_dump(), "arch": {**dict(spec.arch), ARCH_KEY: info}})


def transform_items(spec: ModelSpec, items: tuple, layer: int) -> tuple:
    """A family's entries for layer `layer` (-1 outside the layers) as a wire spec (`wire_spec`) lists them: the
    entries unchanged for any other spec."""
    raw = spec.arch_value(ARCH_KEY)
    if raw is None:
        return items
    info = dict(raw)
    scheme = Fp8Scheme(block=tuple(info["block"]), ignored=tuple(info.get("ignored", ())),
                       activation_scheme=info.get("activation_scheme", "dynamic"))
    receiver = frozenset(info.get("receiver", ()))  # the entries the receiver quantizes itself

    def entries(e: Entry) -> list[Entry]:
        if not is_quantized(spec, scheme, e, layer):
            return [e]
        kind = kind_of(spec, e.role)
        if e.name in receiver:
            return [Entry(e.name, e.shape, staged_kind(kind))]
        return [Entry(e.name, e.shape, kind, dtype=FP8),
                Entry(scale_name(e.name), tuple(_blocks(x, b) for x, b in zip(e.shape, scheme.block)),
                      scale_kind(kind, e.shape, scheme.block), dtype=SCALE_DTYPE)]

    out: list = []
    for item in items:
        if isinstance(item, Experts):
            out.append(Experts(tuple(x for e in item.entries for x in entries(e)), item.count))
        else:
            out.extend(entries(item))
    return tuple(out)


def quantized_entries(spec: ModelSpec, scheme: Fp8Scheme) -> dict[str, tuple[Hashable, Shape]]:
    """HF name template -> (role, shape) of every entry an FP8 engine of `scheme` quantizes (in any layer)."""
    out: dict[str, tuple[Hashable, Shape]] = {}
    for items, layer in entry_lists(spec):
        for item in items:
            for e in (item.entries if isinstance(item, Experts) else (item,)):
                if is_quantized(spec, scheme, e, layer):
                    out.setdefault(e.name, (e.role, e.shape))
    return out


__all__ = ["AMAX_FLOOR", "FP8", "FP8_MAX", "Fp8Scheme", "LINEAR_ROLES", "STAGING", "ScaledCut",
           "is_quantized", "quantized_entries", "scale_kind", "scale_name", "staged_kind", "transform_items",
           "wire_spec"]
