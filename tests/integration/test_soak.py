"""A short soak (benchmarks/soak.py runs the long one): consecutive refits of a tiny model between two CPU
processes over gloo, NIXL and shared memory, then refits interrupted at random points. Threads stay exactly flat and
the soak leaves no /dev/shm segment (harness.shm: only its own processes' count), open file descriptors stay flat
too (NIXL's within one: UCX's own socket comes and goes), resident memory within a few MiB, the store's keys flat
over consecutive refits, every checked refit byte-identical to the local executor's, and no process hangs."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.soak import run

pytestmark = pytest.mark.fault
REFITS, INTERRUPTS = 150, 12
RSS_SLACK = 8 << 20  # allocator noise and torch's bounded flight recorder (gloo), not a per-refit leak
# UCX opens and closes a socket of its own now and then: NIXL's count moves by one either way, never grows
FD_SLACK = {"gloo": 0, "nixl": 1, "shared": 0}
KEYS_IN_FLIGHT = 8


@pytest.mark.parametrize("kind", ["gloo", pytest.param("nixl", marks=pytest.mark.nixl), "shared"])
def test_soak_keeps_resources_flat(tmp_path: Path, kind: str):
    if kind == "nixl":
        pytest.importorskip("nixl")
    out = run(kind, tmp_path, REFITS, INTERRUPTS, interrupt_timeout=1.0, sample_every=25, check_every=10,
              limit=300)
    assert not out["hung"] and out["exitcodes"] == [0, 0], \
        f"processes {out['hung']} hung; exit codes {out['exitcodes']}; their stacks: {out['stacks']}"
    assert not out["shm_left"], f"shared-memory segments were left in /dev/shm: {out['shm_left'][:5]}"
    for p in (0, 1):
        r = out[f"process{p}"]
        assert r is not None and not r["errors"], r and r["errors"]
        assert r["wrong"] == 0
        warm, last = r["samples"][1], r["samples"][-1]  # after the first 25 refits: buffers and lanes exist
        assert last["threads"] == warm["threads"] and last["fds"] - warm["fds"] <= FD_SLACK[kind], r["samples"]
        assert last["rss"] - warm["rss"] < RSS_SLACK, r["samples"]
        # the peer samples at another moment of its refit: the keys of the versions in flight come and go; a leak
        # would add some with every one of the 125 refits in between
        assert last["store_keys"] <= warm["store_keys"] + KEYS_IN_FLIGHT, r["samples"]
        ints = r["interrupts"]
        assert len(ints) == INTERRUPTS and any(x["outcome"] != "completed" for x in ints), ints
        first, final = ints[0], ints[-1]
        assert final["threads"] == first["threads"] and final["fds"] - first["fds"] <= FD_SLACK[kind], ints
        assert final["rss"] - first["rss"] < RSS_SLACK, ints
