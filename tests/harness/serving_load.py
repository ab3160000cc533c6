"""A bounded continuous request loop against a `vllm serve` (issue 40): client threads each stream greedy
completions back to back until stopped, and every token's arrival time is kept, so a test or benchmark can count
what the engine generated in any window (a refit's transfer, its pause), the longest wait between two tokens
of one stream across a window (the stall its user saw), and how each request ended.

    with RequestLoop(server.url, model, clients=4, max_tokens=64) as loop:
        result = session.refit("v2")
    loop.tokens_between(t0, t1); loop.longest_gap(t0, t1); loop.median_gap(outside=[(t0, t1)])
    loop.requests   # [Request(start, end, arrivals, finish_reason, error)]
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Request:
    """One streamed completion as its client saw it."""

    start: float
    end: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each token's arrival
    finish_reason: str | None = None
    error: str | None = None  # the engine's or the connection's error, if it ended with one


class RequestLoop:
    """`clients` threads streaming completions of `max_tokens` tokens from prompt `prompt` back to back, each
    request bounded by `timeout` seconds (a request that hangs is recorded as an error, never waited for longer).
    Client i starts `stagger * i` seconds after the first: clients started together are batched together, end
    together and are between requests together, when the engine holds none of theirs."""

    def __init__(self, url: str, model: str, clients: int = 4, max_tokens: int = 64,
                 prompt: list[int] | None = None, timeout: float = 120.0, stagger: float = 0.0) -> None:
        self.url, self.model, self.max_tokens, self.timeout = url.rstrip("/"), model, max_tokens, timeout
        self.stagger = stagger
        self.prompt = prompt or [1, 2, 3, 4, 5]
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), name=f"load-{i}", daemon=True)
                        for i in range(clients)]

    def __enter__(self) -> "RequestLoop":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout + 10)

    def _client(self, i: int) -> None:
        self.stop.wait(self.stagger * i)
        while not self.stop.is_set():
            r = Request(time.perf_counter())
            with self.lock:
                self.requests.append(r)
            self._one(r)
            r.end = time.perf_counter()

    def _one(self, r: Request) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "stream": True, "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                for line in response:
                    line = line.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        r.error = str(chunk["error"])
                        continue
                    now = time.perf_counter()
                    for choice in chunk.get("choices", []):
                        ids = choice.get("token_ids")
                        r.arrivals.extend([now] * (len(ids) if ids is not None else 1))
                        r.finish_reason = choice.get("finish_reason") or r.finish_reason
        except urllib.error.HTTPError as e:
            r.error = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
        except Exception as e:  # noqa: BLE001 - a timeout or a closed connection: recorded, the loop goes on
            r.error = f"{type(e).__name__}: {e}"
            time.sleep(0.05)

    def tokens_between(self, t0: float, t1: float) -> int:
        """Tokens that arrived in [t0, t1) (perf_counter), over every request."""
        with self.lock:
            return sum(1 for r in self.requests for t in r.arrivals if t0 <= t < t1)

    def spanning(self, t0: float, t1: float) -> list[Request]:
        """The requests that began before t0 and ended after t1 (in flight across that window)."""
        with self.lock:
            return [r for r in self.requests if r.start < t0 and (r.end == 0.0 or r.end > t1)]

    def gaps(self) -> list[tuple[float, float]]:
        """(earlier, later) arrival of every two consecutive chunks of one stream; tokens that came in one chunk
        are one arrival (no gap between them)."""
        with self.lock:
            times = [sorted(set(r.arrivals)) for r in self.requests]
        return [(a, b) for ts in times for a, b in zip(ts, ts[1:])]

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest wait between two consecutive tokens of any stream that overlaps [t0, t1] (0.0 if none): the
        stall a user streaming across that window saw."""
        return max((b - a for a, b in self.gaps() if b > t0 and a < t1), default=0.0)

    def median_gap(self, outside: Sequence[tuple[float, float]] = ()) -> float:
        """The median wait between consecutive tokens of a stream, over the gaps that overlap none of the windows
        `outside` (one decode step under this load, away from refits); 0.0 if there is none."""
        kept = [b - a for a, b in self.gaps() if not any(b > t0 and a < t1 for t0, t1 in outside)]
        return statistics.median(kept) if kept else 0.0
