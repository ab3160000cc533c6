"""A plan as a few readable lines: what moves, how balanced, against the bound and the common pattern."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _rank_table(label: str, values: tuple[int, ...], width: int = 8) -> list[str]:
    """Bytes by rank in rows of `width` ranks; long runs of equal rows are folded."""
    lines, prev, folded = [], None, 0
    for start in range(0, len(values), width):
        chunk = values[start:start + width]
        cells = " ".join(f"{human_bytes(v):>10}" for v in chunk)
        if cells == prev:
            folded += 1
            continue
        if folded:
            lines.append(f"    {'':>9} ... {folded} more rows of ranks like the one above")
            folded = 0
        lines.append(f"    {label} {start:>4}-{start + len(chunk) - 1:<4} {cells}")
        prev = cells
    if folded:
        lines.append(f"    {'':>9} ... {folded} more rows of ranks like the one above")
    return lines


def _shifts(plan: "Plan") -> str:
    by_value: dict[float, int] = {}
    for value in plan.value_shifts.values():
        by_value[value] = by_value.get(value, 0) + 1
    return ", ".join(f"{v:+g} on {n} tensor{'s' * (n > 1)}" for v, n in sorted(by_value.items()))


def _own_dtypes(plan: "Plan") -> str:
    own = plan.own_dtypes
    dtypes = "/".join(sorted(set(own.values())))
    n = len(own)
    return (f"{n} tensor{'s' * (n > 1)} kept in {dtypes} travel bit-exact as {plan.dst.dtype} units "
            f"(e.g. {next(iter(own))})")


def _colocation_text(plan: "Plan") -> str:
    if plan.rank_for_rank:
        return "  (colocated with source ranks)"
    c = plan.colocation
    shown = ", ".join(f"{d}->{s}" for d, s in enumerate(c[:16])) + (", ..." if len(c) > 16 else "")
    return f"  (colocated: destination->source rank {shown})"


def summary(plan: "Plan") -> str:
    a = plan.accounting
    lb = a.lower_bound_bytes or 1
    lines = [
        f"reshard plan {plan.digest[:12]}",
        f"  model        {plan.src.model}",
        f"  source       {plan.src}",
        f"  destination  {plan.dst}" + (_colocation_text(plan) if plan.colocated else ""),
        f"  selection    {len(plan.selection)} tensors" if plan.selection is not None else "  selection    whole model",
        f"  coverage     {plan.coverage} (every destination element holding model data written once)",
        f"  ops          {a.num_ops:,} in {a.num_transfers:,} transfers (source->destination pairs)",
        f"  total        {human_bytes(a.total_bytes)} ({a.total_bytes:,} B)"
        + (f"; {human_bytes(a.cross_bytes)} cross devices, {human_bytes(a.local_bytes)} local copies"
           if plan.colocated else ""),
        f"  lower bound  {human_bytes(a.lower_bound_bytes)} ({a.total_bytes / lb:.3f}x of bound)",
        f"  gather+bcast {human_bytes(a.gather_broadcast_bytes)} ({a.gather_broadcast_bytes / lb:.1f}x of bound)",
        f"  busiest      sender {human_bytes(a.max_egress)} (balance {a.egress_balance:.3f}x mean), "
        f"receiver {human_bytes(a.max_ingress)}",
        f"  senders      busiest {a.egress_optimality:.4f}x of the bound no choice of senders beats "
        f"({human_bytes(a.egress_lower_bound)}"
        + (f"; guaranteed within one unit, {human_bytes(a.egress_unit_max)})" if a.holder_sets_laminar
           else "; holder sets not laminar: no guarantee)"),
        *([f"  fan-out      {plan.roots} root replica(s) fed by the source, {len(plan.replica_parent)} tree(s), "
           f"depth {plan.tree_depth}, {a.num_stages} stages; busiest relay {human_bytes(a.max_relay_egress)}"]
          if plan.fanout else []),
        *([f"  value shift  {_shifts(plan)} (added after the copy: the two sides store these values differently)"]
          if plan.value_shifts else []),
        *([f"  own dtype    {_own_dtypes(plan)}"] if plan.own_dtypes else []),
        f"  compile      {plan.compile_seconds:.3f} s",
        "  egress by source rank:",
        *_rank_table("src", a.egress_bytes),
        "  ingress by destination rank:",
        *_rank_table("dst", a.ingress_bytes),
    ]
    return "\n".join(lines)
