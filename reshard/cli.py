"""`reshard plan`: compile a refit plan from the command line and print its summary or JSON; predict its time on
a cluster (`--predict`), draw it (`--plot`)."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import PlanError, ReshardError


def _topology(args: argparse.Namespace):
    from .planner.cost import Topology

    return Topology(gpus_per_node=args.gpus_per_node, nvlink_bandwidth=args.nvlink_gbs * 1e9,
                    nvlink_bidirectional=args.nvlink_bidir_gbs * 1e9, nvlink_latency=args.nvlink_latency_us * 1e-6,
                    network_bandwidth=args.nic_gbps * 1e9 / 8, network_latency=args.network_latency_us * 1e-6,
                    copy_bandwidth=args.copy_tbs * 1e12, op_overhead=args.op_overhead_us * 1e-6,
                    pipelined=args.pipelined, dst_first_gpu=args.dst_first_gpu)


def _plan(args: argparse.Namespace) -> int:
    from .layouts import ModelSpec, parse_layout
    from .planner import compile_plan

    model = ModelSpec.from_hf_config(args.model)
    if args.dtype:
        model = model.model_copy(update={"dtype": args.dtype})
    src, dst = parse_layout(args.src, model), parse_layout(args.dst, model)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    tensors = args.tensors.split(",") if args.tensors else None
    colocated = args.colocated
    if isinstance(colocated, str):
        try:
            colocated = [int(x) for x in colocated.split(",")]
        except ValueError:
            raise PlanError(f"--colocated {args.colocated!r}: expected source ranks, comma-separated (e.g. 1,0)") \
                from None
    plan = compile_plan(src, dst, tensors=tensors, layers=layers, colocated=colocated, fanout=args.fanout,
                        roots=args.roots, relay_cap=args.relay_cap)
    prediction = None
    if args.predict:
        from .planner.cost import predict

        prediction = predict(plan, _topology(args))
    if args.save:
        plan.save(args.save)
    if args.plot:
        from .planner.plot import plot_plan

        plot_plan(plan, args.plot)
    if args.json:
        a = plan.accounting
        out = {
            "model": str(model), "src": str(src), "dst": str(dst), "digest": plan.digest,
            "coverage": plan.coverage, "compile_seconds": plan.compile_seconds, "roots": plan.roots,
            "colocation": list(plan.colocation) if plan.colocation is not None else None,
            "value_shifts": {plan.src.model.tensor_name(i): v for i, v in plan.value_shifts.items()},
            "own_dtypes": plan.own_dtypes,
            "tree_depth": plan.tree_depth, **a.to_dict(),
        }
        if not args.pairs:
            out.pop("pair_bytes")
            out.pop("relay_pair_bytes")
        if prediction is not None:
            out["predicted_seconds"] = prediction.seconds
            out["predicted_busiest"] = str(prediction.busiest)
            out["predicted_stages"] = [s.seconds for s in prediction.stages]
        json.dump(out, sys.stdout)
        print()
    else:
        print(plan)
        if prediction is not None:
            from .planner.cost import format_prediction

            print(format_prediction(prediction))
        if args.save:
            print(f"  saved        {args.save}")
        if args.plot:
            print(f"  plot         {args.plot}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from .validate import main_validate

    return main_validate(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reshard", description="Plan and run weight refits between layouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="compile a refit plan (a dry run: nothing moves)")
    p.add_argument("--model", required=True, help="HF config.json (or a checkpoint directory holding one)")
    p.add_argument("--dtype", help="override the model's dtype (e.g. float8_e4m3fn to size an FP8 refit)")
    p.add_argument("--src", required=True, help="source layout, e.g. megatron:tp=4,pp=2,ep=8,etp=1,world=64")
    p.add_argument("--dst", required=True, help="destination layout, e.g. vllm:tp=8,replicas=8")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.add_argument("--pairs", action="store_true", help="with --json, include bytes per (source, destination) pair")
    p.add_argument("--colocated", nargs="?", const=True, default=False, metavar="SRC_RANKS",
                   help="destination rank d shares a GPU with source rank d (its bytes from there are local copies); "
                        "or give the source rank on each destination rank's GPU, comma-separated (e.g. 1,0)")
    p.add_argument("--fanout", type=int, help="feed ROOTS destination replicas and relay to the others along trees "
                   "where each replica has at most FANOUT children")
    p.add_argument("--roots", type=int, help="with --fanout: replicas the source feeds (default: the fewest "
                   "holders any source byte has)")
    p.add_argument("--relay-cap", type=int, default=1, help="with --fanout: no destination rank relays more than "
                   "RELAY_CAP times what it receives (default 1)")
    p.add_argument("--layers", help="only these layers' tensors, comma-separated (a subset plan)")
    p.add_argument("--tensors", help="only these canonical tensor names, comma-separated (a subset plan)")
    p.add_argument("--save", help="write the plan to this .npz or .json file")
    p.add_argument("--plot", help="draw the source x destination byte matrix (and the trees) into this image")
    t = p.add_argument_group("time prediction (--predict)")
    t.add_argument("--predict", action="store_true", help="predict the plan's wall time on a cluster")
    t.add_argument("--gpus-per-node", type=int, default=8)
    t.add_argument("--nic-gbps", type=float, default=400.0, help="NIC per GPU, Gb/s each direction (default 400)")
    t.add_argument("--network-latency-us", type=float, default=10.0)
    t.add_argument("--nvlink-gbs", type=float, default=366.0, help="NVLink one direction per GPU, GB/s")
    t.add_argument("--nvlink-bidir-gbs", type=float, default=676.0, help="NVLink both directions per GPU, GB/s")
    t.add_argument("--nvlink-latency-us", type=float, default=36.0)
    t.add_argument("--copy-tbs", type=float, default=4.2, help="device copy, read+write TB/s")
    t.add_argument("--op-overhead-us", type=float, default=0.0, help="per op on the busiest GPU")
    t.add_argument("--pipelined", action="store_true", help="stages overlap (relays forward chunks as they arrive)")
    t.add_argument("--dst-first-gpu", type=int, help="GPU of destination rank 0 (default: after the source's)")
    p.set_defaults(func=_plan)
    v = sub.add_parser("validate", help="run a family's validation stages on a tiny instance of a config")
    v.add_argument("--model", required=True, help="HF config.json (or a checkpoint directory holding one)")
    v.add_argument("--stages", help="comma-separated subset of: discovery, megatron layout, vllm layout, "
                   "hf parity, vllm load parity, round trip")
    v.add_argument("--vllm-python", help="python of a virtualenv with vLLM, for the vLLM stages when this one "
                   "has none")
    v.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="vLLM model dtype in the vllm load parity stage (default bfloat16, as served)")
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
