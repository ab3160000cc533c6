"""What NeMo-RL's and verl's backends share: every trainer process holds whole HF tensors and every inference
process hands whole HF tensors to vLLM's loaders, so the model moves in groups of at most `bucket_size` bytes, one
plan and one executor per group; and the options and refusals of both. How the processes agree:
integrations.agreement.
"""
from __future__ import annotations

import asyncio
import contextlib
import difflib
import sys
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Sequence

from ..arguments import seconds
from ..errors import ArgumentError, ExecutionError, LayoutMismatchError
from ..executors.base import Executor
from ..executors.binding import Binding
from ..layouts import HfLayout, ModelSpec
from ..planner import Plan
from ..planner.cache import cached_plan

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch

    from .agreement import Agreement
    from .streams import StreamNames

POLL_S = 0.05  # how often a trainer draining its stream checks the store for a failure posted elsewhere
DEPTH = 2  # collective: rounds in flight (wire buffers: DEPTH x peers x one message, within the bucket)
STAGINGS = ("bucket", "model")
# every option both integrations take, and its types (verl's engine_kwargs.reshard holds exactly these)
OPTION_TYPES = {"transport": str, "fanout": (int, type(None)), "staging": str, "checksum": (bool, str),
                "timeout": (int, float), "backend": (str, type(None)), "delta": (int, type(None))}


def check_options(options: dict[str, Any], prefix: str = "", transports: Sequence[str] | None = None
                  ) -> dict[str, Any]:
    """The options both integrations take (any subset of transport, fanout, staging, checksum, timeout, backend,
    delta), checked, as plain JSON values (a round trip); `delta` needs "model" staging and no fan-out.

    Args:
        options: option -> value.
        prefix: what errors put before an option's name ("engine_kwargs.reshard.").
        transports: the transports allowed (None: every cross-process transport).

    Raises:
        ArgumentError: a value of the wrong type or outside its range, named with `prefix`.
    """
    import json

    from ..adapters.transports import cross_process_transports
    from ..executors.checksum import algorithm

    for key, value in options.items():
        numeric = key in ("fanout", "timeout", "delta")
        if not isinstance(value, OPTION_TYPES[key]) or (isinstance(value, bool) and numeric):
            raise ArgumentError(prefix + key, value, f"has type {type(value).__name__}")
    if options.get("staging", "bucket") not in STAGINGS:
        raise ArgumentError(prefix + "staging", options["staging"], f"must be one of {STAGINGS}")
    transport = options.get("transport", "collective")
    allowed = tuple(cross_process_transports() if transports is None else transports)
    if transport not in allowed:
        raise ArgumentError(prefix + "transport", transport, f"must be one of the cross-process transports {allowed}")
    if options.get("fanout") is not None and options["fanout"] < 1:
        raise ArgumentError(prefix + "fanout", options["fanout"], "must be a positive integer or None")
    if "timeout" in options:
        seconds(prefix + "timeout", options["timeout"])
    if options.get("delta") is not None:
        if not 1 <= options["delta"] <= 1 << 30:
            raise ArgumentError(prefix + "delta", options["delta"], "must be K in [1, 2^30] (a dense keyframe every "
                                "K versions) or None (every refit dense)")
        if options.get("staging", "bucket") != "model":
            raise ArgumentError(prefix + "delta", options["delta"], "needs staging: model (the buckets of staging "
                                "bucket are reused within a refit, so no earlier version is left to apply a delta "
                                "to)", fix="set staging: model (the whole model held on each inference worker)")
        if options.get("fanout") is not None:
            raise ArgumentError(prefix + "delta", options["delta"], "needs fanout unset (delta plans have no relays)")
    try:
        algorithm(options.get("checksum", False))
    except ArgumentError as e:
        raise ArgumentError(prefix + "checksum", e.value, e.rule) from None
    return json.loads(json.dumps(options))


def refuse_unknown(given: Any, known: Sequence[str], where: str, of: str) -> None:
    """Refuse (ArgumentError) the keys of `given` not in `known`, naming each with the closest known key (`where`:
    what holds them, `of`: what takes them)."""
    names = sorted(set(given) - set(known))
    if names:
        hints = [f"{n!r} -> {close[0]!r}" for n in names if (close := difflib.get_close_matches(n, known, 1))]
        raise ArgumentError(f"{where} key{'s' * (len(names) > 1)} {', '.join(map(repr, names))}",
                            rule=f"{'are not options' if len(names) > 1 else 'is not an option'} of {of}; its "
                                 f"options: {', '.join(known)}",
                            fix=f"did you mean {'; '.join(hints)}" if hints else "remove it")


def refuse_serving(options: Any, prefix: str, why: str, guide: str) -> None:
    """Refuse reshard's refit while the engine generates (`pause_for`; `staging` "device" / "host") in `options`:
    the framework holds its engine for the whole refit (`why`: where, by file and line; `guide`:
    docs/guides/<guide>.md says more). Raises ArgumentError naming the option (`prefix` before it), why and the fix.
    """
    key = "pause_for" if "pause_for" in options else "staging" if options.get("staging") in ("device", "host") else ""
    if key:
        raise ArgumentError(prefix + key, options[key], "is reshard's refit while the engine generates "
                            "(TrainerSession(pause_for='flip'), RefitSpec(staging='device' | 'host')), which this "
                            f"backend cannot honour: {why}", fix=f"remove it, staging bucket or model; "
                            f"docs/guides/{guide}.md, 'Refit while the engine generates', says what it would need")


def refuse_moved_experts(where: str) -> None:
    """Refuse a refit into an EPLB engine whose experts moved, before any byte lands: vLLM's `load_weights` writes
    each expert slot by vLLM's initial placement, never the EPLB state's (vLLM 0.33: routed_experts.py:1004-1007,
    1207-1216, 1274-1288). The placement is read from the vLLM worker up the call stack (NeMo-RL's worker extension
    is mixed into vLLM's worker); with none calling (verl's rollout rank), nothing is refused.

    Raises:
        LayoutMismatchError: naming the engine's placement and the initial one (`check_loader_placement`).
    """
    frame = outer_frame(sys._getframe(1), lambda f: hasattr(f.f_locals.get("self"), "model_runner")
                        and hasattr(f.f_locals.get("self"), "vllm_config"))
    if frame is None:
        return
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

    from ..adapters.vllm.experts import check_loader_placement, live_placement

    model = frame.f_locals["self"].model_runner.get_model()
    moe = get_mixture_of_experts_model(model)
    if moe is None:
        return
    try:
        check_loader_placement(live_placement(model, moe.num_physical_experts // moe.num_local_physical_experts))
    except LayoutMismatchError as e:
        raise LayoutMismatchError("this refit", e.problems, where=f"{where}'s expert placement", fix=(
            "every framework loader writes the initial placement: serve without EPLB (enable_eplb off), or refit "
            "through reshard's vLLM weight-transfer engine, whose TrainerSession follows the placement")) from None


def outer_frame(frame: Any, test: Callable[[Any], bool]) -> Any:
    """The innermost frame from `frame` outwards that passes `test` (None if none): how a framework's objects up the
    call stack are found (its vLLM worker, its checkpoint-engine manager, its trainer)."""
    while frame is not None and not test(frame):
        frame = frame.f_back
    return frame


def check_room(need: int, free: int | None, device: Any, field: str, where: str) -> None:
    """Refuse (ArgumentError naming both sizes) "model" staging of `need` bytes where `free` (None: unknown) is less
    (`field`: the staging option's name; `where`: who stages)."""
    if free is not None and need > free:
        raise ArgumentError(field, "model", f"holds the whole model on every {where}: {need / 2**30:.2f} GiB ({need} "
                            f"bytes), but {device} had {free / 2**30:.2f} GiB ({free} bytes) free when measured",
                            fix="staging: bucket (the default) holds two tensor groups of at most the bucket size; "
                                "a failed refit then leaves some groups of the new version loaded")


def transfer_thread(device: "torch.device | None", name: str) -> "ThreadPoolExecutor":
    """The one thread a process moves its groups on, in order (on CUDA `device`)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    cuda = device is not None and device.type == "cuda"
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=torch.cuda.set_device if cuda else None,
                              initargs=(device,) if cuda else ())


def staging_empty(shape: Sequence[int], dtype: Any, device: Any, shared: bool) -> "torch.Tensor":
    """An empty buffer, in shared memory when `shared` on the CPU (peers write into it)."""
    import torch

    from ..executors.shared import shared_empty

    return shared_empty(tuple(shape), dtype) if shared and device.type == "cpu" else torch.empty(
        tuple(shape), dtype=dtype, device=device)


def synchronize(device: Any) -> None:
    """Wait for this thread's work on a CUDA `device` (before a buffer's reuse); no-op on CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def resolve_device(device: str | None, field: str = "device") -> "torch.device":
    """Where a worker stages the weights (None: CUDA when available, else CPU).

    Raises:
        ArgumentError: not a torch device, or neither CUDA nor the CPU (`field` is what the error names).
    """
    import torch

    try:
        out = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError):
        raise ArgumentError(field, device, "is not a torch device (e.g. 'cuda', 'cpu')") from None
    if out.type not in ("cuda", "cpu"):
        raise ArgumentError(field, device, "must be a CUDA device or the CPU")
    return out


def model_spec(model: Any, dtype: str | None = None) -> ModelSpec:
    """The ModelSpec of `model` (a ModelSpec, or an HF config dict, config.json or checkpoint directory), in `dtype`.

    Raises:
        ArgumentError: an unreadable config or an unknown dtype.
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_hf_config(model)
    return spec if dtype is None else ModelSpec(**{**spec.model_dump(), "dtype": dtype})


def tensor_bytes(spec: ModelSpec, name: str) -> int:
    """Bytes of one of the model's tensors in its own dtype (KeyError: not one of the model's tensors)."""
    from ..layouts.model import DTYPE_SIZES

    t = spec.tensor(name)
    return t.numel * DTYPE_SIZES[t.dtype or spec.dtype]


def available_bytes(device: "torch.device") -> int | None:
    """Free memory on `device` for "model" staging (CUDA: the device's; CPU: MemAvailable); None if unreadable."""
    from ..adapters.vllm.staging import free_bytes

    with contextlib.suppress(OSError, ExecutionError):
        return free_bytes(device, "device")
    return None


def tensor_groups(spec: ModelSpec, bucket_size: int) -> tuple[tuple[str, ...], ...]:
    """The model's tensors in model order, cut into consecutive groups of at most `bucket_size` bytes (a larger
    tensor is a group of its own). Raises ArgumentError for a bucket size that is not a positive integer."""
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise ArgumentError("bucket_size", bucket_size, "must be a positive number of bytes")
    groups: list[list[str]] = []
    used = 0
    for t in spec.tensors:
        size = tensor_bytes(spec, t.name)
        if not groups or used + size > bucket_size:
            groups.append([])
            used = 0
        groups[-1].append(t.name)
        used += size
    return tuple(map(tuple, groups))


def group_plans(spec: ModelSpec, trainers: int, rollouts: int, groups: Sequence[Sequence[str]],
                fanout: int | None = None, roots: int | None = None) -> list[Plan]:
    """One plan per group: each tensor held whole by all `trainers` source ranks and needed whole by all `rollouts`
    destination ranks, compiled once per process (planner.cache). `groups` is `tensor_groups`' result; with
    `fanout`, rollouts relay to at most that many others, `roots` of them fed by the trainers (None: the compiler's
    choice). Raises PlanError / ArgumentError from the compiler."""
    src, dst = HfLayout(model=spec, replicas=trainers), HfLayout(model=spec, replicas=rollouts)
    extra = {} if fanout is None or rollouts < 2 else \
        {"fanout": fanout} if roots is None else {"fanout": fanout, "roots": roots}
    return [cached_plan(src, dst, tensors=tuple(group), **extra) for group in groups]


def group_bindings(plans: Sequence[Plan], trainers: int, rollouts: int) -> tuple[Binding, ...]:
    """One Binding per plan: which process plays each rank (0..trainers-1 the trainers, then the rollouts). Across
    groups the busiest source rank goes to the trainer that has sent least so far; destination rank d of group k
    is rollout (d + k) mod rollouts, spreading fan-out roots."""
    sent = [0] * trainers
    out = []
    for k, plan in enumerate(plans):
        egress = plan.accounting.egress_bytes
        ranks = sorted(range(trainers), key=lambda s: (-egress[s], s))
        least = sorted(range(trainers), key=lambda p: (sent[p], p))
        src = [0] * trainers
        for s, p in zip(ranks, least):
            src[s] = p
            sent[p] += egress[s]
        out.append(Binding(tuple(src), tuple(trainers + (d + k) % rollouts for d in range(rollouts))))
    return tuple(out)


def group_executor(transport: str, plan: Plan, binding: Binding, process: int, tensors: dict[str, Any], *,
                   store: Any, rendezvous: Any, namespace: str, comm: Any = None, timeout: float = 300.0,
                   checksum: bool | str = False, memory_cap: int = 1 << 30, delta: Any = None) -> Executor:
    """This process's executor for one group's plan, writing the destination tensors in place (the caller hands
    them on only once every process agreed); `refit(version)` moves the group once per call.

    Args:
        transport: "collective" (over `comm`, a StoreComm every process joined), "shared" or "nixl" (keys under
            `namespace`, unique per executor: letters and digits, in the rendezvous's store).
        plan, binding, process: the group's plan, who plays its ranks, this process.
        tensors: this process's tensors of the group (name -> tensor), for every rank it plays; "shared" on CPU:
            destinations in shared memory.
        store, rendezvous, namespace, comm: where the processes meet (see `transport`).
        timeout, checksum: the executors' options.
        memory_cap: "collective": bytes of wire buffers (DEPTH rounds x peers x one message).
        delta: an executors.delta.DeltaPolicy (None: every refit dense).

    Raises:
        ArgumentError: an unregistered transport.
        ExecutionError: what the executor refuses at construction, or a peer that did not set up in time.
    """
    from ..adapters.transports import Endpoint, open_transport, transport as registered

    # beyond timeout, checksum and in-place writes (a rollout process may wait on the trainers' stream for seconds
    # per group: shared polls back off to 5 ms)
    extra = {"collective": {"memory_cap": memory_cap, "depth": DEPTH}, "shared": {"poll_max_s": 0.005}}
    options = {**registered(transport).in_place, "timeout": timeout, "checksum": checksum, **extra.get(transport, {})}
    src, dst = ({r: tensors for r in ranks(process)} for ranks in (binding.src_ranks_of, binding.dst_ranks_of))
    return open_transport(transport, Endpoint(plan, binding, process, src, dst, options, store=store,
                                              rendezvous=rendezvous, namespace=namespace, comm=comm, delta=delta))


def refuse(executor: Executor, process: int, version: int, reason: str) -> None:
    """Fail refit `version` of a group's executor on every process at once, from this process: through the
    collective executor's preflight or the voted executors' failure record. Never raises."""
    from ..executors.voted import VotedExecutor

    with contextlib.suppress(Exception):  # expected: the refusal itself raises here
        if isinstance(executor, VotedExecutor):
            executor.exchange.fail(version, f"process {process}: {reason}")
            return
        binding = executor.binding
        # no tensors for the ranks this process plays: its preflight refuses, and every process learns it there
        executor.refit(src={r: {} for r in binding.src_ranks_of(process)},
                       dst={r: {} for r in binding.dst_ranks_of(process)})


def delta_totals(reports: Iterable[Any]) -> dict[str, int]:
    """A refit's keyframe groups, groups, and delta (wire) and dense bytes, from its groups' DeltaReports."""
    reports = list(reports)
    return {"keyframes": sum(r.keyframe for r in reports), "groups": len(reports),
            "wire_bytes": sum(r.wire_bytes for r in reports), "dense_bytes": sum(r.dense_bytes for r in reports)}


async def stream_items(weights: Any) -> AsyncIterator[Any]:
    """The items of a synchronous or asynchronous iterable (a synchronous one drained on the event loop's thread)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def send_groups(weights: Any, names: "StreamNames", where: dict[str, int], who: str, agreement: "Agreement",
                      take: Callable[[str, "torch.Tensor", int], Iterable[int]], start: Callable[[int], "Future"],
                      fail: Callable[[BaseException, "Future | None"], "Future | None"]
                      ) -> tuple[int, int, BaseException | None, "Future | None"]:
    """A trainer's side of one refit: drain and check the stream `weights` (sync or async; every item, even after a
    failure: producing it may be collective), hand each of the model's tensors to `take(name, tensor, k)`, which
    returns the groups now complete, and move those with `start(k)` (a Future of the bytes sent), one in flight.
    `fail(error, flight)` posts a failure (a Future to await, or None); `who` streams (errors name it); the
    `agreement` is checked every POLL_S, and its `end` posted once the stream was complete and moved. Returns (bytes
    sent, items taken while a group moved, the error or None, the failure's Future or None); raises the exporter's
    own error (after `fail`: no stream is left to drain)."""
    seen: set[str] = set()
    flight: Future | None = None
    refusal: Future | None = None
    error: BaseException | None = None
    sent = overlapped = started = 0
    polled = time.monotonic()
    try:
        async for name, tensor in stream_items(weights):
            if error is not None:
                continue
            overlapped += flight is not None and not flight.done()  # stream items taken while a group moved
            try:
                for hf, piece in names.checked(name, tensor, seen):
                    for k in take(hf, piece, where[hf]):
                        if flight is not None:  # memory: one group moving, this one waiting for it
                            sent += await asyncio.wrap_future(flight)
                        flight, started = start(k), started + 1
                if flight is not None and flight.done() and flight.exception() is not None:
                    raise flight.exception()
                if time.monotonic() - polled > POLL_S:  # a refusal elsewhere: stop sending now, not at the end
                    polled = time.monotonic()
                    agreement.check()
            except Exception as e:  # noqa: BLE001 - a wrong tensor, a failed copy or transfer, a refusal elsewhere
                error, refusal = e, fail(e, flight)
    except BaseException as e:  # the exporter itself failed
        if error is None and (refusal := fail(e, flight)) is not None:
            await asyncio.wrap_future(refusal)
        raise
    if error is None and started < max(where.values()) + 1:  # the stream ended before every group was complete
        error = names.never_came(seen, who)
        refusal = fail(error, flight)
    if flight is not None:
        try:
            sent += await asyncio.wrap_future(flight)  # a transfer begun is finished: its peers are inside it
        except Exception as e:  # noqa: BLE001 - named by the transfer
            if error is None:
                error, refusal = e, fail(e, None)
    if error is None:
        agreement.end()  # this trainer's stream was complete and valid, and moved
    return sent, overlapped, error, refusal


async def receive_groups(count: int, move: Callable[[int], "Future"], bucket: bool, device: Any,
                         agreement: "Agreement", fail: Callable[[BaseException, "Future | None", int], "Future | None"],
                         agreed: bool = False) -> AsyncIterator[tuple[int, Any]]:
    """A rollout's side of one refit: `move(i)` moves the i-th of `count` groups on the transfer thread (a Future of
    (group k, what landed)), the next one while the last is handed on; yields (k, what landed) once every process
    agreed on it ("bucket"; with `agreed`, `agreement.agreed` too) or on the whole model, the last group after the
    trainers' end-of-stream verdict. A failure before the verdict (GeneratorExit: the caller stopped taking) goes to
    `fail(error, flight, next i)` (a Future to await, or None) and is raised."""
    flight: Future | None = move(0)
    held: list[tuple[int, Any]] = []
    following, verdict = 1, False
    try:
        for i in range(count):
            held.append(await asyncio.wrap_future(flight))
            flight = None
            if following < count:
                if bucket:
                    synchronize(device)  # the loads from the other bucket (group i - 1) are done
                flight, following = move(following), following + 1  # lands while group i is handed on
            if bucket or i == count - 1:
                for k, _ in held if agreed else ():
                    await agreement.agreed(k)
                if i == count - 1:
                    await agreement.ended()
                    verdict = True
                for item in held:
                    yield item
                held = []
    except BaseException as e:  # noqa: BLE001 - also the generator closed or cancelled at a yield
        if not verdict and (refusal := fail(e, flight, following)) is not None:  # the others stop now
            await asyncio.wrap_future(refusal)
        raise


__all__ = ["DEPTH", "OPTION_TYPES", "STAGINGS", "available_bytes", "check_options", "check_room", "delta_totals",
           "group_bindings", "group_executor", "group_plans", "model_spec", "outer_frame", "receive_groups", "refuse",
           "refuse_serving", "refuse_unknown", "resolve_device", "send_groups", "staging_empty", "stream_items",
           "synchronize", "tensor_bytes", "tensor_groups", "transfer_thread"]
