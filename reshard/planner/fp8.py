"""Quantizing refits: a bf16 source into an FP8 block-scaled destination, each block quantized once, where it
halves the wire.

`compile_fp8` decides per quantized tensor kind (an HF name template) where its blocks are quantized: by the
**sender** when every source rank holding part of it holds whole blocks (and no physical source tensor mixes it
with a kind quantized elsewhere), so only fp8 bytes and float32 scales cross the wire; else by the **receiver**,
into which it travels in the model's dtype. It then compiles one ordinary plan over the wire spec
(`layouts.fp8.wire_spec`), which the coverage proof, the accounting and every executor handle unchanged; a rank
quantizes the pieces the plan reads from it (`quantize_by_src`). A destination whose cuts split a block is
refused, naming tensor, dim and block, before anything is compiled.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LayoutError, ModelConfigError, PlanError
from ..layouts import Layout, Placement
from ..layouts.fp8 import FP8, Fp8Scheme, quantized_entries, scale_name, wire_spec
from ..layouts.model import ModelSpec, TensorSpec
from .compiler import check_same_model, compile_plan
from .plan import Plan, human_bytes


@dataclass(frozen=True, eq=False)
class Fp8Plan:
    """A quantizing refit: the wire plan and where each tensor kind's blocks are quantized.

    `where`: HF name template -> "sender" | "receiver"; `why`: for each receiver kind, the reason.
    `plan`: the plan executors run (fp8 + scales for sender kinds, the model's dtype for receiver kinds).
    `baseline_bytes`: what the same refit moves when every quantized tensor travels in the model's dtype and is
    quantized by the receiver (the bytes without sender-side quantization)."""

    scheme: Fp8Scheme
    model: ModelSpec  # the model's own spec (bf16)
    plan: Plan
    where: dict[str, str]
    why: dict[str, str]
    baseline_bytes: int
    full_dst: Layout  # the destination with every quantized tensor in fp8 + scales (where receivers write)

    @property
    def src(self) -> Layout:
        """The wire plan's source layout (the model's fp8 kinds as the senders send them)."""
        return self.plan.src

    @property
    def dst(self) -> Layout:
        """The wire plan's destination layout (receiver kinds in the model's dtype, for staging)."""
        return self.plan.dst

    @property
    def wire_bytes(self) -> int:
        """Bytes the wire plan moves (compare `baseline_bytes`)."""
        return int(self.plan.accounting.total_bytes)

    @functools.cached_property
    def sender_tensors(self) -> tuple[tuple[int, int], ...]:
        """(weight index, scale index) in the wire spec of every tensor quantized by senders."""
        spec = self.plan.src.model
        return tuple((t.index, spec.tensor(scale_name(t.name)).index) for t in spec.tensors if t.dtype == FP8)

    @functools.cached_property
    def receiver_tensors(self) -> tuple[TensorSpec, ...]:
        """The wire spec's tensors quantized by receivers (their templates are `where == "receiver"`)."""
        receiver = {k for k, v in self.where.items() if v == "receiver"}
        spec = self.plan.src.model
        templates = _templates(spec)
        return tuple(t for t in spec.tensors if templates[t.index] in receiver)

    @functools.cached_property
    def quantize_by_src(self) -> dict[int, tuple[str, ...]]:
        """Source rank -> the physical source tensors whose fp8 pieces that rank quantizes: those the plan reads
        from it, as fp8 weight or as scale (a holder read for a scale computes it from the weight). Ops adjacent
        in memory are merged across canonical tensors (q, k, v in one run), never across physical tensors, so
        reads are known per physical tensor and so is the work."""
        ops, table = self.plan.ops, self.plan.src_tensors
        own = table.own_dtypes()
        side0 = ops["src_side"] == 0
        out: dict[int, set[str]] = {}
        for rank, tid in set(zip(ops["src_rank"][side0].tolist(), ops["src_tensor"][side0].tolist())):
            name = table.name(tid)
            dtype = own.get((rank, name), self.plan.src.dtype)  # a float32 trainer's scales: its own dtype
            if dtype == FP8:
                out.setdefault(rank, set()).add(name)
            elif dtype == "float32" and "_scale_inv" in name:  # a scale (TE's grouped experts: weight_scale_inv{j})
                out.setdefault(rank, set()).add(name.replace("_scale_inv", ""))
        return {r: tuple(sorted(v)) for r, v in sorted(out.items())}

    def sender_pieces(self, rank: int) -> list[tuple[Placement, Placement]]:
        """(weight piece, scale piece) pairs that source rank `rank` quantizes (`quantize_by_src`)."""
        mine = set(self.quantize_by_src.get(rank, ()))
        layout, spec = self.plan.src, self.plan.src.model
        out = []
        for w, s in self.sender_tensors:
            wp = [p for p in layout.placements(spec.tensor_at(w)) if p.rank == rank]
            sp = [p for p in layout.placements(spec.tensor_at(s)) if p.rank == rank]
            if len(wp) != len(sp):
                raise PlanError(f"{spec.tensor_name(w)}: {len(wp)} weight pieces but {len(sp)} scale pieces on "
                                f"source rank {rank}")
            out.extend((a, b) for a, b in zip(wp, sp) if a.tensor in mine and all(a.lengths))
        return out

    @functools.cached_property
    def quantize_elements(self) -> tuple[list[int], list[int]]:
        """Elements quantized per source rank and per destination rank (receivers' staging)."""
        src, dst = self.plan.src, self.plan.dst
        by_src = [0] * src.num_ranks
        for rank in self.quantize_by_src:
            by_src[rank] = sum(int(np.prod(a.lengths)) for a, _ in self.sender_pieces(rank))
        by_dst = [0] * dst.num_ranks
        for p in (p for t in self.receiver_tensors for p in dst.placements(t)):
            by_dst[p.rank] += int(np.prod(p.lengths))
        return by_src, by_dst

    def summary(self) -> dict[str, Any]:
        """The accounting `reshard plan` prints: wire bytes both ways, where each kind is quantized, the work."""
        by_src, by_dst = self.quantize_elements
        return {"block": list(self.scheme.block), "wire_bytes": self.wire_bytes,
                "wire_bytes_without_sender_quantization": self.baseline_bytes,
                "wire_ratio": self.wire_bytes / self.baseline_bytes if self.baseline_bytes else 1.0,
                "where": dict(sorted(self.where.items())), "why_receiver": dict(sorted(self.why.items())),
                "quantize_elements_by_src": by_src, "quantize_elements_by_dst": by_dst,
                "ignored": list(self.scheme.ignored)}

    def text(self) -> str:
        """`summary` as the lines `reshard plan` prints under the plan."""
        s = self.summary()
        senders = sum(v == "sender" for v in self.where.values())
        lines = [f"  fp8          {self.scheme.block[0]}x{self.scheme.block[1]} blocks, e4m3fn + float32 "
                 f"weight_scale_inv; {senders} of {len(self.where)} quantized tensor kinds on the sender",
                 f"  wire         {human_bytes(s['wire_bytes'])} with sender-side quantization, "
                 f"{human_bytes(s['wire_bytes_without_sender_quantization'])} without ({s['wire_ratio']:.3f}x)",
                 f"  quantize     busiest sender {max(s['quantize_elements_by_src'] or [0]):,} elements, busiest "
                 f"receiver {max(s['quantize_elements_by_dst'] or [0]):,} elements"]
        return "\n".join(lines + [f"    receiver   {k}: {why}" for k, why in s["why_receiver"].items()])


@functools.lru_cache(maxsize=16)
def _templates(spec: ModelSpec) -> tuple[str, ...]:
    """Per canonical tensor of `spec`, its entry's HF name template."""
    c = spec.canonical
    return tuple(c.entries[int(e)].name for e in c.entry.tolist())


def _on(layout: Layout, spec: ModelSpec) -> Layout:
    return type(layout).model_validate({**layout.model_dump(), "model": spec})


def _source_physical(src: Layout, spec: ModelSpec, templates: dict[str, Any]) -> dict[str, set[str]]:
    """Per quantized template, the physical source tensors (names) its first tensor lives in."""
    first: dict[str, int] = {}
    for k, name in enumerate(_templates(spec)):
        if name in templates:
            first.setdefault(name, k)
    return {name: {p.tensor for p in src.placements(spec.tensor_at(k)) if all(p.lengths)} for name, k in first.items()}


def decide(src: Layout, scheme: Fp8Scheme) -> tuple[dict[str, str], dict[str, str]]:
    """Where each quantized tensor kind is quantized (see the module doc), and why the receivers are."""
    spec = src.model
    templates = quantized_entries(spec, scheme)
    why: dict[str, str] = {}
    for name, (_, shape) in templates.items():
        if shape[1] % 2:
            why[name] = f"{shape[1]} columns: fp8 travels in pairs of elements"
    for _ in range(len(templates) + 1):  # each pass moves at least one kind to the receivers, or ends
        try:
            _on(src, wire_spec(spec, scheme, why))
            break
        except LayoutError as e:
            tensor = str((e.values or {}).get("tensor", "")) if hasattr(e, "values") else ""
            hit = [n for n in templates if n not in why and _matches(n, tensor)]
            if not hit:
                raise
            why[hit[0]] = f"the source's cuts split blocks ({e})"
    # Kinds sharing a physical source tensor travel alike (one tensor cannot hold fp8 and bf16 data).
    phys = _source_physical(src, spec, templates)
    while shared := next(((a, b) for a in templates if a not in why for b in why if b in phys and phys[a] & phys[b]),
                         None):
        a, b = shared
        why[a] = f"shares source tensor {sorted(phys[a] & phys[b])[0]!r} with {b} (quantized by receivers)"
    return {n: "receiver" if n in why else "sender" for n in templates}, why


def _matches(template: str, name: str) -> bool:
    """Whether canonical tensor `name` (a weight or its scale) is an instance of HF name template `template`."""
    pattern = re.escape(template).replace(r"\{i\}", r"\d+").replace(r"\{e\}", r"\d+")
    return re.fullmatch(pattern + r"(_scale_inv)?", name) is not None


def compile_fp8(src: Layout, dst: Layout, scheme: Fp8Scheme, *, sender_quantization: bool = True,
                **options: Any) -> Fp8Plan:
    """The quantizing refit from `src` (the model's dtype) into an FP8 destination of `scheme` (see the module
    doc). `sender_quantization=False` quantizes everything on the receivers. `options` go to `compile_plan`."""
    check_same_model(src, dst)
    spec = src.model
    if spec.dtype == FP8:
        raise ModelConfigError(field="dtype", value=spec.dtype, rule="the source is already float8: refitting "
                               "an FP8 source into FP8 blocks would quantize twice", fix="refit from bf16 weights")
    templates = quantized_entries(spec, scheme)
    if not templates:
        raise ModelConfigError(field="quantization_config", value=scheme.to_quantization_config(),
                               rule=f"leaves no tensor of this {spec.family} model quantized")
    # every quantized tensor in fp8 + scales: a cut that splits a block is refused here (LayoutError naming tensor,
    # dim and block) -- vLLM refuses the same TP when it builds the engine
    full_dst = _on(dst, wire_spec(dst.model, scheme))
    if sender_quantization:
        where, why = decide(src, scheme)
    else:
        where, why = {n: "receiver" for n in templates}, {n: "sender-side quantization off" for n in templates}
    receiver = [n for n, w in where.items() if w == "receiver"]
    wire = wire_spec(spec, scheme, receiver)
    plan = compile_plan(_on(src, wire), _on(dst, wire), **options)
    if len(receiver) == len(templates):
        baseline = int(plan.accounting.total_bytes)
    else:
        everything = wire_spec(spec, scheme, list(templates))
        baseline = int(compile_plan(_on(src, everything), _on(dst, everything), **options).accounting.total_bytes)
    return Fp8Plan(scheme, spec, plan, where, why, baseline, full_dst)


__all__ = ["Fp8Plan", "compile_fp8", "decide"]
