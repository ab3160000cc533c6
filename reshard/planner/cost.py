"""Predicted wall time of a plan: a bandwidth model over link classes.

Each transfer is `device` (both ranks on one GPU: a colocated copy), `nvlink` (two GPUs of one node) or `network`
(two nodes, through each GPU's NIC). A stage takes as long as its busiest resource (a GPU's copy engine, NVLink
port or NIC: bytes / bandwidth; NVLink and NICs full duplex, NVLink capped in total), plus its transfers' latency
and a per-op cost; executors that pack into wire buffers or stage what they receive add device copies
(`pack_copies`, `commit_copies`) that overlap the wire or follow it. Stages run in sequence, or, `pipelined`,
overlap: then the busiest resource over all stages, plus one chunk and one latency per tree level. Defaults: an
NVLink node and a 400 Gb/s NIC per GPU (BENCHMARKS.md, predicted refit times).

Source rank s sits on GPU s, destination rank d on GPU `dst_first_gpu` + d (default: after the source's), or on
its colocated source rank's GPU; `src_gpus` / `dst_gpus` place them anywhere. GPU g is in node g // gpus_per_node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..arguments import instance, integer, integers, number
from ..errors import ArgumentError, PlanError
from .accounting import flows
from .plan import Plan
from .program import RELAY, SOURCE

LINK_CLASSES = ("device", "nvlink", "network")


@dataclass(frozen=True)
class ClusterModel:
    """Where ranks sit and how fast things move, for `predict`. Bandwidths in bytes/s, latencies in seconds.

    Attributes:
        gpus_per_node: GPU g is in node g // gpus_per_node.
        nvlink_bandwidth: one direction, per GPU (NCCL send/recv).
        nvlink_bidirectional: both directions together, per GPU.
        nvlink_latency: per transfer (fit of NCCL send/recv 256 MiB vs 2 GiB).
        network_bandwidth: one direction, per GPU: one 400 Gb/s NIC.
        network_latency: per transfer between nodes.
        copy_bandwidth: device memory, read + write counted: a copy of B bytes moves 2B.
        copy_latency: per device copy.
        op_overhead: per op, on the busiest GPU (executors that launch a kernel per op).
        pack_copies: device copies of every crossing byte on its sender and its receiver (wire buffers).
        commit_copies: device copies of every byte a GPU receives after it lands (a staged commit), counted on
            GPUs that receive anything from another GPU.
        overlap_copies: pack/commit copies overlap the wire (bucketed pipelines) or follow it.
        pipelined: stages overlap as relays forward chunks while they arrive.
        chunk_bytes: pipelined relays forward this much before the next level can start.
        dst_first_gpu: the GPU of destination rank 0 (None: right after the source ranks' GPUs).
        src_gpus: the GPU of every source rank (overrides the default order).
        dst_gpus: the GPU of every destination rank (overrides the rest).

    Raises:
        ArgumentError: a figure of the wrong type.
        PlanError: a bandwidth that is not positive, or a latency or overhead that is negative.
    """

    gpus_per_node: int = 8
    nvlink_bandwidth: float = 366e9
    nvlink_bidirectional: float = 676e9
    nvlink_latency: float = 36e-6
    network_bandwidth: float = 50e9
    network_latency: float = 10e-6
    copy_bandwidth: float = 4.2e12
    copy_latency: float = 5e-6
    op_overhead: float = 0.0
    pack_copies: float = 0.0
    commit_copies: float = 0.0
    overlap_copies: bool = True
    pipelined: bool = False
    chunk_bytes: int = 64 << 20
    dst_first_gpu: int | None = None
    src_gpus: tuple[int, ...] | None = None
    dst_gpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "chunk_bytes"):
            integer(name, getattr(self, name), 1, 1 << 62)
        positive = ("nvlink_bandwidth", "nvlink_bidirectional", "network_bandwidth", "copy_bandwidth")
        non_negative = ("nvlink_latency", "network_latency", "copy_latency", "op_overhead", "pack_copies",
                        "commit_copies")
        for name in positive + non_negative:
            number(name, getattr(self, name))
        for name in ("overlap_copies", "pipelined"):
            instance(name, getattr(self, name), bool, "a bool")
        if self.dst_first_gpu is not None:
            integer("dst_first_gpu", self.dst_first_gpu, 0, 1 << 30)
        for name in ("src_gpus", "dst_gpus"):
            gpus = getattr(self, name)
            integers(name, gpus)
            if isinstance(gpus, (set, frozenset)):  # one GPU per rank, in rank order
                raise ArgumentError(name, gpus, "must be a list or tuple (in rank order), not a set")
            if gpus is not None and any(g < 0 for g in gpus):
                raise ArgumentError(name, gpus, "must list non-negative GPU numbers")
        bad = [n for n in positive if getattr(self, n) <= 0] + [n for n in non_negative if getattr(self, n) < 0]
        if bad:
            raise PlanError("cluster model figures must be positive (latencies and overheads non-negative)", bad)


@dataclass(frozen=True)
class Resource:
    """One GPU's port of one kind and the load on it."""

    kind: str  # "copy", "nvlink out", "nvlink in", "nvlink both", "nic out", "nic in"
    gpu: int
    role: str  # which ranks sit on the GPU, e.g. "src 3" or "dst 17" or "src 3 + dst 3"
    nbytes: int
    seconds: float

    def __str__(self) -> str:
        return f"{self.kind} of GPU {self.gpu} ({self.role}): {self.nbytes / 1e9:.2f} GB in {self.seconds:.4f} s"


@dataclass(frozen=True)
class StagePrediction:
    """One stage's predicted time: the busiest resource's transfer time plus latency and per-op costs, with the
    bytes by link class that it comes from."""

    stage: int
    seconds: float
    transfer_seconds: float  # the busiest resource
    latency_seconds: float
    op_seconds: float
    busiest: Resource | None
    bytes_by_class: dict[str, int]


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted wall time and where it goes (`format_prediction` prints it).

    Attributes:
        seconds: the predicted wall time.
        pipelined: whether stages were taken to overlap (`ClusterModel.pipelined`).
        stages: per stage, its time, busiest resource and bytes by link class.
        busiest: the bottleneck over the whole plan (not pipelined: the slowest stage's); None without ops.
        depth: fan-out tree depth (stages - 1).
        cluster: the model the prediction assumed.
    """

    seconds: float
    pipelined: bool
    stages: tuple[StagePrediction, ...]
    busiest: Resource | None
    depth: int
    cluster: ClusterModel = field(repr=False)

    @property
    def bytes_by_class(self) -> dict[str, int]:
        """Bytes over all stages per link class (LINK_CLASSES)."""
        return {c: sum(s.bytes_by_class[c] for s in self.stages) for c in LINK_CLASSES}


def transfer_table(plan: Plan) -> dict[str, np.ndarray]:
    """Per transfer (stage, side, sender, receiver): bytes and ops, from the factored plan (EPLB slot copies, inside
    an engine, are not modelled)."""
    fed, relay = flows(plan.program, plan.itemsize)
    keep = ~relay["copy"]
    cols = {c: np.concatenate([fed[c], relay[c][keep]]) for c in ("stage", "src", "dst", "bytes", "ops")}
    side = np.concatenate([np.full(len(fed["src"]), SOURCE), np.full(int(keep.sum()), RELAY)])
    base, num_dst = max(plan.src.num_ranks, plan.dst.num_ranks), plan.dst.num_ranks
    uniq, inverse = np.unique(((cols["stage"] * 2 + side) * base + cols["src"]) * num_dst + cols["dst"],
                              return_inverse=True)
    inverse = inverse.reshape(-1)
    return {"stage": uniq // num_dst // base // 2, "side": uniq // num_dst // base % 2, "src": uniq // num_dst % base,
            "dst": uniq % num_dst, "bytes": np.bincount(inverse, weights=cols["bytes"]).astype(np.int64),
            "ops": np.bincount(inverse, weights=cols["ops"]).astype(np.int64)}


def _rank_gpus(plan: Plan, cluster: ClusterModel) -> tuple[np.ndarray, np.ndarray]:
    """GPU of every source rank and of every destination rank."""
    S, D = plan.src.num_ranks, plan.dst.num_ranks
    src = np.asarray(cluster.src_gpus if cluster.src_gpus is not None else range(S), dtype=np.int64)
    if cluster.dst_gpus is not None:
        dst = np.asarray(cluster.dst_gpus, dtype=np.int64)
    elif plan.colocation is not None:  # on the GPU of the source rank it shares a device with
        dst = src[np.asarray(plan.colocation, dtype=np.int64)]
    else:
        dst = (int(src.max(initial=-1)) + 1 if cluster.dst_first_gpu is None else cluster.dst_first_gpu) + np.arange(D)
    if len(src) != S or len(dst) != D:
        raise PlanError(f"the cluster model places {len(src)} source and {len(dst)} destination ranks; the plan has "
                        f"{S} and {D}")
    return src, dst


def _stage(cluster: ClusterModel, src_gpu: np.ndarray, dst_gpu: np.ndarray, nbytes: np.ndarray, ops: np.ndarray,
           s: int, role) -> tuple[StagePrediction, dict[str, np.ndarray]]:
    """Stage `s` from its transfers' GPUs, bytes and ops; and the seconds each resource of each GPU is busy."""
    n = int(max(src_gpu.max(initial=0), dst_gpu.max(initial=0))) + 1
    count = lambda gpu, m: np.bincount(gpu[m], weights=nbytes[m], minlength=n)  # noqa: E731
    same = src_gpu == dst_gpu
    nv = ~same & (src_gpu // cluster.gpus_per_node == dst_gpu // cluster.gpus_per_node)
    net = ~same & ~nv
    load = {"nvlink out": count(src_gpu, nv), "nvlink in": count(dst_gpu, nv), "nic out": count(src_gpu, net),
            "nic in": count(dst_gpu, net)}
    load["nvlink both"] = load["nvlink out"] + load["nvlink in"]
    received = count(dst_gpu, ~same)
    # staging shadows only tensors that receive bytes from another process: a GPU fed only by local copies stages
    # nothing (its copies run once, at commit)
    copies = (count(src_gpu, same) + cluster.pack_copies * (count(src_gpu, ~same) + received)
              + cluster.commit_copies * count(dst_gpu, np.ones(len(same), dtype=bool)) * (received > 0))
    bw = _bandwidths(cluster)
    times = {k: v / bw[k] for k, v in load.items()}
    copy_time = 2 * copies / cluster.copy_bandwidth  # a copy reads and writes
    shown = {k: (load[k], times[k]) for k in load}
    if copy_time.any():  # copies overlap the wire, or follow it on each GPU
        shown["copy" if cluster.overlap_copies else "wire + copy"] = (
            copies, copy_time if cluster.overlap_copies else np.max(list(times.values()), axis=0) + copy_time)
    busiest, worst = None, 0.0
    for kind, (b, t) in shown.items():
        g = int(np.argmax(t))
        if t[g] > worst:
            busiest, worst = Resource(kind, g, role(g), int(b[g]), float(t[g])), float(t[g])
    latency = max([cluster.copy_latency] * bool(same.any()) + [cluster.nvlink_latency] * bool(nv.any())
                  + [cluster.network_latency] * bool(net.any()), default=0.0)
    per_gpu_ops = np.bincount(src_gpu, weights=ops, minlength=n) + np.bincount(dst_gpu, weights=ops, minlength=n)
    op_secs = float(per_gpu_ops.max(initial=0)) * cluster.op_overhead
    classes = {"device": same, "nvlink": nv, "network": net}
    pred = StagePrediction(
        stage=s, seconds=worst + latency + op_secs, transfer_seconds=worst, latency_seconds=latency,
        op_seconds=op_secs, busiest=busiest, bytes_by_class={c: int(nbytes[m].sum()) for c, m in classes.items()})
    return pred, {**times, "copy": copy_time}


def predict(plan: Plan, cluster: ClusterModel | None = None) -> Prediction:
    """The plan's predicted wall time on `cluster`, from bytes per link, latencies and per-op costs.

    Args:
        plan: the plan.
        cluster: where its ranks sit and how fast links are (default: 8-GPU NVLink nodes, a 400 Gb/s NIC per GPU).

    Returns:
        The total and, per stage, the busiest resource.

    Raises:
        ArgumentError: `plan` or `cluster` of the wrong type.
        PlanError: a cluster model that places another number of ranks than the plan has.
    """
    instance("plan", plan, Plan, "a Plan")
    instance("cluster", cluster, ClusterModel, "a ClusterModel", none=True)
    cluster = cluster or ClusterModel()
    tr = transfer_table(plan)
    src, dst = _rank_gpus(plan, cluster)
    src_gpu = np.where(tr["side"] == RELAY, dst[np.minimum(tr["src"], len(dst) - 1)],
                       src[np.minimum(tr["src"], len(src) - 1)])
    dst_gpu = dst[tr["dst"]]

    def role(gpu: int) -> str:
        """Which ranks sit on `gpu`, e.g. "src rank 3 + dst rank 3"."""
        roles = [f"{side} rank {int(r)}" for side, gpus in (("src", src), ("dst", dst))
                 for r in np.flatnonzero(gpus == gpu)[:2]]
        return " + ".join(roles) or "idle"

    masks = [tr["stage"] == s for s in range(plan.num_stages)]
    if not masks:
        return Prediction(0.0, cluster.pipelined, (), None, 0, cluster)
    stages, times = zip(*(_stage(cluster, src_gpu[m], dst_gpu[m], tr["bytes"][m].astype(np.float64), tr["ops"][m],
                                 s, role) for s, m in enumerate(masks)))
    depth = plan.num_stages - 1
    if not cluster.pipelined:
        slowest = max(stages, key=lambda x: x.transfer_seconds)
        return Prediction(sum(x.seconds for x in stages), False, stages, slowest.busiest, depth, cluster)
    # Pipelined: all stages share the resources; each level beyond the first adds one chunk and one latency.
    size = max(len(v) for t in times for v in t.values())
    total = {k: sum(np.pad(t[k], (0, size - len(t[k]))) for t in times) for k in times[0]}
    kind = max(total, key=lambda k: total[k].max(initial=0))
    g = int(np.argmax(total[kind]))
    secs = float(total[kind][g])
    nbytes = secs * _bandwidths(cluster)[kind] / (2 if kind == "copy" else 1)
    busiest = Resource(kind, g, role(g), int(nbytes), secs)
    link_bw = {"device": cluster.copy_bandwidth / 2, "nvlink": cluster.nvlink_bandwidth,
               "network": cluster.network_bandwidth}
    fill = sum(min(cluster.chunk_bytes, max(x.bytes_by_class.values()))
               / min((link_bw[c] for c, n in x.bytes_by_class.items() if n), default=cluster.network_bandwidth)
               + x.latency_seconds for x in stages[1:])
    overhead = stages[0].latency_seconds + sum(x.op_seconds for x in stages)
    return Prediction(secs + fill + overhead, True, stages, busiest, depth, cluster)


def _bandwidths(cluster: ClusterModel) -> dict[str, float]:
    """Bytes/s of each kind of resource of a GPU."""
    return {"copy": cluster.copy_bandwidth, "nvlink out": cluster.nvlink_bandwidth,
            "nvlink in": cluster.nvlink_bandwidth, "nvlink both": cluster.nvlink_bidirectional,
            "nic out": cluster.network_bandwidth, "nic in": cluster.network_bandwidth}


def format_prediction(pred: Prediction) -> str:
    """A few lines: total, where the time goes (busiest resource per stage), bytes by link class.

    Args:
        pred: a prediction from `predict`.

    Returns:
        The lines, joined by newlines.

    Raises:
        ArgumentError: `pred` is not a Prediction.
    """
    instance("pred", pred, Prediction, "a Prediction (from predict)")
    mode = "pipelined stages" if pred.pipelined else "stages in sequence"
    by = pred.bytes_by_class
    lines = [f"  predicted    {pred.seconds:.4f} s ({mode}; tree depth {pred.depth})",
             *([f"  busiest      {pred.busiest}"] if pred.busiest is not None else []),
             "  link bytes   " + ", ".join(f"{c} {by[c] / 1e9:.2f} GB" for c in LINK_CLASSES)]
    lines += [f"    stage {s.stage}: {s.seconds:.4f} s = transfer {s.transfer_seconds:.4f} + latency "
              f"{s.latency_seconds * 1e6:.0f} us + ops {s.op_seconds:.4f}; busiest {s.busiest}" for s in pred.stages]
    return "\n".join(lines)


def compare_with_measurement(plan: Plan, measured_seconds: float, cluster: ClusterModel | None = None) -> str:
    """One line for benchmarks: prediction beside measurement, with the relative error and the bottleneck.

    Args:
        plan: the plan that ran.
        measured_seconds: how long it took.
        cluster: as for `predict`.

    Returns:
        The line.

    Raises:
        ArgumentError: `measured_seconds` is not a positive number.
        PlanError: as from `predict`.
    """
    if number("measured_seconds", measured_seconds) <= 0:
        raise ArgumentError("measured_seconds", measured_seconds, "must be a positive number of seconds")
    pred = predict(plan, cluster)
    err = (pred.seconds - measured_seconds) / measured_seconds
    where = f"; busiest {pred.busiest}" if pred.busiest is not None else ""
    return (f"predicted {pred.seconds:.4f} s, measured {measured_seconds:.4f} s, error {err:+.1%} "
            f"(target within 15%){where}")
