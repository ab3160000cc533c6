"""The `reshard` command line: `plan` compiles a refit plan and prints its summary or JSON, predicts its time on a
cluster (`--predict`), draws it (`--plot`); `validate` runs reshard.validate's stages; `verify`, reshard.verify's."""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Callable, NoReturn

from .arguments import PLAN_SUFFIXES, PLOT_SUFFIXES, output_path
from .errors import ArgumentError, ReshardError
from .limits import MAX_RANKS

_INT = re.compile(r"[+-]?[0-9]{1,12}")  # ASCII digits (int() also reads other scripts' digits)
_FLOAT_MAX = 1e9  # every float flag is a bandwidth, latency or overhead in units where 1e9 is beyond any link


def _int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], in ASCII digits."""
    def parse(text: str) -> int:
        if not _INT.fullmatch(text.strip()) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be a whole number in [{low}, {high:,}]")
        return int(text)
    return parse


def _float(low: float, positive: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= low (> low with `positive`), at most _FLOAT_MAX."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (positive and value == low) or value > _FLOAT_MAX:
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number {'>' if positive else '>='} {low:g} "
                                             f"and at most {_FLOAT_MAX:g}")
        return value
    return parse


def _ints(flag: str, text: str, low: int, high: int) -> list[int]:
    parts = text.split(",")
    if len(parts) > MAX_RANKS or not all(_INT.fullmatch(p.strip()) for p in parts):
        raise ArgumentError(flag, text, "must list whole numbers, comma-separated (e.g. 0,1)")
    values = [int(p) for p in parts]
    bad = [v for v in values if not low <= v < high]
    if bad:
        raise ArgumentError(flag, text, f"lists {bad[:5]} outside [{low}, {high})")
    return values


CHECKPOINT_SOURCE = "megatron-ckpt:"


def _source(text: str, model):
    """A declared layout, or `megatron-ckpt:PATH[,readers=N]`: the reader layout of a megatron-core torch_dist
    checkpoint, derived from its metadata and checked against the model (no tensor is read)."""
    from .layouts import parse_layout

    if not text.lower().startswith(CHECKPOINT_SOURCE):
        return parse_layout(text, model)
    path, readers = text[len(CHECKPOINT_SOURCE):], 1
    head, sep, tail = path.rpartition(",readers=")
    if sep:
        if not _INT.fullmatch(tail.strip()) or not 1 <= int(tail) <= MAX_RANKS:
            raise ArgumentError("--src", text, f"readers={tail!r} must be a whole number in [1, {MAX_RANKS}]")
        path, readers = head, int(tail)
    if not path:
        raise ArgumentError("--src", text, "must name the checkpoint directory: megatron-ckpt:PATH[,readers=N]")
    from .adapters.megatron.checkpoint import open_checkpoint
    from .adapters.megatron.checkpoint_layout import checkpoint_layout

    return checkpoint_layout(open_checkpoint(path), model, readers=readers)


def _plan(args: argparse.Namespace) -> int:
    from .layouts import ModelSpec, parse_layout
    from .planner import compile_plan

    for flag, path, suffixes in (("--save", args.save, PLAN_SUFFIXES), ("--plot", args.plot, PLOT_SUFFIXES)):
        if path is not None:  # refused before any work is done (the API's rule: Plan.save)
            output_path(flag, path, suffixes)
    model = ModelSpec.from_hf_config(args.model)
    if args.dtype is not None:
        model = ModelSpec(**{**model.model_dump(), "dtype": args.dtype})
    src, dst = _source(args.src, model), parse_layout(args.dst, model)
    layers = _ints("--layers", args.layers, 0, model.num_layers) if args.layers is not None else None
    tensors = args.tensors.split(",") if args.tensors is not None else None
    colocated = args.colocated
    if isinstance(colocated, str):
        colocated = _ints("--colocated", colocated, 0, src.num_ranks)
    options = dict(tensors=tensors, layers=layers, colocated=colocated, fanout=args.fanout, roots=args.roots,
                   relay_cap=args.relay_cap)
    fp8 = None
    if args.fp8:  # an FP8 block-scaled destination: quantizing plan, bytes with and without sender quantization
        from .layouts.fp8 import Fp8Scheme
        from .planner.fp8 import compile_fp8

        scheme = Fp8Scheme.from_hf_config(args.model if args.fp8 is True else args.fp8)
        fp8 = compile_fp8(src, dst, scheme, **options)
        plan = fp8.plan
    else:
        plan = compile_plan(src, dst, **options)
    prediction = None
    if args.predict:
        from .planner.cost import ClusterModel, predict

        prediction = predict(plan, ClusterModel(
            gpus_per_node=args.gpus_per_node, nvlink_bandwidth=args.nvlink_gbs * 1e9,
            nvlink_bidirectional=args.nvlink_bidir_gbs * 1e9, nvlink_latency=args.nvlink_latency_us * 1e-6,
            network_bandwidth=args.nic_gbps * 1e9 / 8, network_latency=args.network_latency_us * 1e-6,
            copy_bandwidth=args.copy_tbs * 1e12, op_overhead=args.op_overhead_us * 1e-6, pipelined=args.pipelined,
            dst_first_gpu=args.dst_first_gpu))
    if args.plot:
        try:
            from .planner.plot import plot_plan
        except ImportError as e:
            raise ArgumentError("--plot", args.plot, f"needs matplotlib ({e})") from None
    for flag, path, write in (("--save", args.save, plan.save), ("--plot", args.plot, lambda p: plot_plan(plan, p))):
        try:
            if path:
                write(path)
        except OSError as e:
            raise ArgumentError(flag, path, f"cannot be written ({e.strerror or e})") from None
    if args.json:
        out = {"model": str(model), "src": str(src), "dst": str(dst), "digest": plan.digest,
               "coverage": plan.coverage, "compile_seconds": plan.compile_seconds, "roots": plan.roots,
               "colocation": list(plan.colocation) if plan.colocation is not None else None,
               "value_shifts": {plan.src.model.tensor_name(i): v for i, v in plan.value_shifts.items()},
               "own_dtypes": plan.own_dtypes, "tree_depth": plan.tree_depth, **plan.accounting.to_dict()}
        if not args.pairs:
            out.pop("pair_bytes")
            out.pop("relay_pair_bytes")
        if fp8 is not None:
            out["fp8"] = fp8.summary()
            out.pop("own_dtypes")  # every fp8 weight and scale: fp8.where says it per tensor kind
        if prediction is not None:
            out.update(predicted_seconds=prediction.seconds, predicted_busiest=str(prediction.busiest),
                       predicted_stages=[s.seconds for s in prediction.stages])
        print(json.dumps(out))
    else:
        print(plan)
        if fp8 is not None:
            print(fp8.text())
        if prediction is not None:
            from .planner.cost import format_prediction

            print(format_prediction(prediction))
        for label, path in (("saved", args.save), ("plot", args.plot)):
            if path:
                print(f"  {label:<12} {path}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    """`reshard validate`: prints the results; 1 where a stage failed, else 0."""
    from .validate import FAIL, validate

    results = validate(args.model, stages=args.stages.split(",") if args.stages else None,
                       vllm_python=args.vllm_python, examples=args.examples,
                       vllm_dtype=args.vllm_dtype, vllm_cpu_python=args.vllm_cpu_python)
    if args.json:
        print(json.dumps([r.__dict__ for r in results]))
    else:
        width = max(len(r.stage) for r in results)
        print(f"{'stage':<{width}}  {'result':<7}  {'time':>6}  detail")
        for r in results:
            print(f"{r.stage:<{width}}  {r.status:<7}  {r.seconds:5.1f}s  {r.detail}")
    return 1 if any(r.status == FAIL for r in results) else 0


def _verify(args: argparse.Namespace) -> int:
    """`reshard verify`: the mismatch between the HF checkpoint and the server on `args.sequences` random sequences
    of `args.seed`; prints the report, the exit status is 1 above the thresholds."""
    from pathlib import Path

    from .adapters.server import VllmServer
    from .verify import checkpoint_scores, compare, engine_scores, random_sequences

    config = json.loads(Path(args.checkpoint, "config.json").read_text())
    vocab = (config.get("text_config") or config).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2:
        raise ArgumentError("vocab_size", vocab, f"of {args.checkpoint}/config.json must be an integer >= 2")
    seqs = random_sequences(vocab, args.sequences, args.length, args.seed)
    report = compare(checkpoint_scores(args.checkpoint, seqs), engine_scores(VllmServer(args.server), seqs), args.dtype)
    print(json.dumps(report.to_dict()) if args.json else str(report))
    return 0 if report.ok else 1


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line on stderr and exit status 2, like the library's."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Run the `reshard` command line (default argv: sys.argv[1:]); the exit code, 2 for an input refused."""
    from .validate import STAGES

    parser = _Parser(prog="reshard", description="Plan and run weight refits between layouts.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="compile a refit plan (a dry run: nothing moves)")
    p.add_argument("--model", required=True, help="HF config.json (or a checkpoint directory holding one)")
    p.add_argument("--dtype", help="override the model's dtype (e.g. float8_e4m3fn to size an FP8 refit)")
    p.add_argument("--src", required=True, help="source layout, e.g. megatron:tp=4,pp=2,ep=8,etp=1,world=64; or "
                   "megatron-ckpt:PATH[,readers=N], a megatron-core torch_dist checkpoint read by N processes")
    p.add_argument("--dst", required=True, help="destination layout, e.g. vllm:tp=8,replicas=8")
    p.add_argument("--fp8", nargs="?", const=True, default=False, metavar="CONFIG",
                   help="an FP8 block-scaled destination, from the quantization_config of --model's config (or of "
                   "CONFIG, the engine's config.json): quantizes on the senders where they hold whole blocks and "
                   "reports wire bytes with and without that")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.add_argument("--pairs", action="store_true", help="with --json, include bytes per (source, destination) pair")
    p.add_argument("--colocated", nargs="?", const=True, default=False, metavar="SRC_RANKS",
                   help="destination rank d shares a GPU with source rank d (its bytes from there are local copies); "
                        "or give the source rank on each destination rank's GPU, comma-separated (e.g. 1,0)")
    ranks, positive, at_least_0 = _int(1, MAX_RANKS), _float(0, positive=True), _float(0)
    p.add_argument("--fanout", type=ranks, help="feed ROOTS destination replicas and relay to the others along trees "
                   "where each replica has at most FANOUT children")
    p.add_argument("--roots", type=ranks, help="with --fanout: replicas the source feeds (default: the fewest "
                   "holders any source byte has)")
    p.add_argument("--relay-cap", type=ranks, default=1, help="with --fanout: no destination rank relays more than "
                   "RELAY_CAP times what it receives (default 1)")
    p.add_argument("--layers", help="only these layers' tensors, comma-separated (a subset plan)")
    p.add_argument("--tensors", help="only these canonical tensor names, comma-separated (a subset plan)")
    p.add_argument("--save", help="write the plan to this .npz or .json file")
    p.add_argument("--plot", help="draw the source x destination byte matrix (and the trees) into this image")
    t = p.add_argument_group("time prediction (--predict)")
    t.add_argument("--predict", action="store_true", help="predict the plan's wall time on a cluster")
    t.add_argument("--gpus-per-node", type=ranks, default=8)
    t.add_argument("--nic-gbps", type=positive, default=400.0, help="NIC per GPU, Gb/s each direction (default 400)")
    t.add_argument("--network-latency-us", type=at_least_0, default=10.0)
    t.add_argument("--nvlink-gbs", type=positive, default=366.0, help="NVLink one direction per GPU, GB/s")
    t.add_argument("--nvlink-bidir-gbs", type=positive, default=676.0, help="NVLink both directions per GPU, GB/s")
    t.add_argument("--nvlink-latency-us", type=at_least_0, default=36.0)
    t.add_argument("--copy-tbs", type=positive, default=4.2, help="device copy, read+write TB/s")
    t.add_argument("--op-overhead-us", type=at_least_0, default=0.0, help="per op on the busiest GPU")
    t.add_argument("--pipelined", action="store_true", help="stages overlap (relays forward chunks as they arrive)")
    t.add_argument("--dst-first-gpu", type=_int(0, MAX_RANKS), help="GPU of destination rank 0 (default: after the "
                   "source's)")
    p.set_defaults(func=_plan)
    v = sub.add_parser("validate", help="run a family's validation stages on a tiny instance of a config")
    v.add_argument("--model", required=True, help="HF config.json (or a checkpoint directory holding one)")
    v.add_argument("--stages", help="comma-separated subset of: " + ", ".join(STAGES))
    v.add_argument("--vllm-python", help="python of a virtualenv with vLLM, for the vLLM stages when this one "
                   "has none")
    v.add_argument("--vllm-cpu-python", help="python of the vLLM CPU virtualenv (a whole engine on CPU), for the "
                   "mismatch stage (default: $RESHARD_VLLM_CPU_PYTHON, else .venv-vllm-cpu)")
    v.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="vLLM model dtype in the vllm load parity stage (default bfloat16, as served)")
    v.add_argument("--examples", type=_int(1, 100_000), default=20, help="random layout pairs in the round-trip stage")
    v.add_argument("--json", action="store_true", help="print the results as JSON")
    v.set_defaults(func=_validate)
    m = sub.add_parser("verify", help="train-inference mismatch: score token sequences with an HF checkpoint "
                       "(transformers) and a running vllm serve; exit 1 above the dtype's thresholds")
    m.add_argument("--checkpoint", required=True, help="HF checkpoint directory of the weights the server should hold")
    m.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the dtype the server computes in (picks the thresholds)")
    m.add_argument("--sequences", type=_int(1, 1024), default=4, help="random token sequences to score (default 4)")
    m.add_argument("--length", type=_int(2, 65536), default=32, help="tokens per sequence (default 32)")
    m.add_argument("--seed", type=_int(0, 2**31), default=0)
    m.add_argument("--json", action="store_true", help="print the report as JSON")
    m.set_defaults(func=_verify)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ReshardError as exc:  # an input the library refused: one line, exit 2; anything else is a bug (exit 1)
        print("reshard: error: " + " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
