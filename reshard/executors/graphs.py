"""Launch-bound work as one CUDA graph: a fixed sequence of launches over tensors that stay where they are.

`Replay` runs a function eagerly the first time (kernels compile) and captures it at the second call; then a call
is one graph launch. Off a GPU, or where capture fails, it runs eagerly. The caller keeps the tensors in place:
`Pins` re-checks their storage addresses before each launch (a storage replaced by `.data = ...` or `set_` would
be written through stale addresses), at tens of nanoseconds a tensor.
"""
from __future__ import annotations

import operator
from typing import Callable, Iterable

import torch

from ..errors import ExecutionError

_data_ptr = torch.Tensor.data_ptr


class Replay:
    """`fn()` eagerly once, then as a captured CUDA graph on `device` (None: always eagerly)."""

    def __init__(self, fn: Callable[[], None], device: "torch.device | None") -> None:
        self.fn, self.device = fn, device
        self.graph: "torch.cuda.CUDAGraph | None" = None
        self.calls = 0
        self.error: str | None = None  # why capture was given up (kept for diagnosis; the eager path still runs)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        if self.device is None or self.calls == 0 or self.error is not None:
            self.calls += 1
            self.fn()
            return
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device):
                torch.cuda.current_stream().synchronize()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self.fn()
        except Exception as e:  # noqa: BLE001 - capture refused (a sync inside, an old driver): stay eager
            self.error = f"{type(e).__name__}: {e}"
            self.fn()
            return
        self.graph = graph
        graph.replay()


def single_cuda_device(tensors) -> "torch.device | None":
    """The one CUDA device every tensor is on, or None (CPU tensors, several devices, none at all)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if device.type == "cuda" else None


_STREAMS: dict[str, list] = {}  # device -> its side streams
STREAMS = 4  # side streams independent launches are spread over (a graph captures them as parallel branches)


def spread(items: list, n: int, size: Callable) -> list[list]:
    """Items dealt into n lists of about equal total size (largest first, each to the lightest list)."""
    bins: list[list] = [[] for _ in range(max(1, n))]
    load = [0] * len(bins)
    for item in sorted(items, key=size, reverse=True):
        k = load.index(min(load))
        bins[k].append(item)
        load[k] += size(item)
    return [b for b in bins if b]


def on_streams(parts: list[Callable[[], None]], device: "torch.device | None") -> None:
    """Run each part on its own side stream after the current stream's work, and make the current stream wait for
    them all: independent launches (disjoint destinations) side by side. Off a GPU, or with one part, in order."""
    if device is None or len(parts) <= 1:
        for fn in parts:
            fn()
        return
    main = torch.cuda.current_stream(device)
    streams = _STREAMS.setdefault(str(device), [])  # made once per process: a captured graph keeps referring to them
    while len(streams) < len(parts):
        streams.append(torch.cuda.Stream(device))
    streams = streams[:len(parts)]
    for s, fn in zip(streams, parts):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            fn()
    for s in streams:
        main.wait_stream(s)


class Pins:
    """The addresses of `tensors` now; `check()` refuses once any of them moved."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tensors = tuple(tensors)
        self.addresses = tuple(map(_data_ptr, self.tensors))

    def check(self) -> None:
        """Raise ExecutionError if any pinned tensor's storage was replaced since."""
        now = tuple(map(_data_ptr, self.tensors))
        if now != self.addresses:
            raise ExecutionError(f"{sum(map(operator.ne, now, self.addresses))} bound tensors were replaced since the "
                                 f"executor was made; update them in place, or make a new executor")
