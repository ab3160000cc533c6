"""`reshard plan`: compile a refit plan from the command line and print its summary or JSON."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import ReshardError


def _plan(args: argparse.Namespace) -> int:
    from .layouts import ModelSpec, parse_layout
    from .planner import compile_plan

    model = ModelSpec.from_hf_config(args.model)
    src, dst = parse_layout(args.src, model), parse_layout(args.dst, model)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    tensors = args.tensors.split(",") if args.tensors else None
    plan = compile_plan(src, dst, tensors=tensors, layers=layers, colocated=args.colocated, fanout=args.fanout)
    if args.save:
        plan.save(args.save)
    if args.json:
        a = plan.accounting
        out = {
            "model": str(model), "src": str(src), "dst": str(dst), "digest": plan.digest,
            "coverage": plan.coverage, "compile_seconds": plan.compile_seconds, **a.to_dict(),
        }
        if not args.pairs:
            out.pop("pair_bytes")
        json.dump(out, sys.stdout)
        print()
    else:
        print(plan)
        if args.save:
            print(f"  saved        {args.save}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from .validate import main_validate

    return main_validate(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reshard", description="Plan and run weight refits between layouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="compile a refit plan (a dry run: nothing moves)")
    p.add_argument("--model", required=True, help="HF config.json (or a checkpoint directory holding one)")
    p.add_argument("--src", required=True, help="source layout, e.g. megatron:tp=4,pp=2,ep=8,etp=1,world=64")
    p.add_argument("--dst", required=True, help="destination layout, e.g. vllm:tp=8,replicas=8")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.add_argument("--pairs", action="store_true", help="with --json, include bytes per (source, destination) pair")
    p.add_argument("--colocated", action="store_true",
                   help="destination rank d shares a GPU with source rank d (its bytes from there are local copies)")
    p.add_argument("--fanout", type=int, help="feed one destination replica and relay to the others along a "
                   "tree where each replica forwards to at most FANOUT others")
    p.add_argument("--layers", help="only these layers' tensors, comma-separated (a subset plan)")
    p.add_argument("--tensors", help="only these canonical tensor names, comma-separated (a subset plan)")
    p.add_argument("--save", help="write the plan to this .npz or .json file")
    p.set_defaults(func=_plan)
    v = sub.add_parser("validate", help="run a family's validation stages on a tiny instance of a config")
    v.add_argument("--model", required=True, help="HF config.json (or a checkpoint directory holding one)")
    v.add_argument("--stages", help="comma-separated subset of: discovery, megatron layout, vllm layout, "
                   "hf parity, vllm load parity, round trip")
    v.add_argument("--vllm-python", help="python of a virtualenv with vLLM, for the vLLM stages when this one "
                   "has none")
    v.add_argument("--examples", type=int, default=20, help="random layout pairs in the round-trip stage")
    v.add_argument("--json", action="store_true", help="print the results as JSON")
    v.set_defaults(func=_validate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ReshardError as exc:
        print(f"reshard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
