"""No untimed wait: a peer frozen at each phase of a refit (harness.frozen_phases.PHASES: the rendezvous,
set-up and plan agreement, a first NIXL refit's wait for peers still setting up, each transfer step, the checksum
exchange, the commit vote, close) for each transport
(gloo collective, NIXL, shared memory). Every survivor ends within the timeout plus SLACK with an ExecutionError,
the one waiting on the victim's step naming it (close: returns without error). The cases run at once, in one
batch (module fixture): a frozen wait costs no CPU.

SLACK as in test_faults (2 s; RESHARD_FAULT_SLACK widens it), against each survivor's own time (harness.clock:
the wall time less the time its threads queued for a CPU), so that the bound measures the library's waits and not
the machine's load: with other work on a 2-core machine the wall time reached 4.24 s for a 2 s timeout.
"""
from __future__ import annotations

import importlib.util
import os
import re

import pytest

from harness.frozen_phases import BY_ID, PHASES, run_cases

pytestmark = pytest.mark.fault
TIMEOUT = 2.0
SLACK = float(os.environ.get("RESHARD_FAULT_SLACK", "2.0"))
HAVE_NIXL = importlib.util.find_spec("nixl") is not None
CASES = [f"{p.kind}-{p.name}" for p in PHASES]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ids = [c for c in CASES if HAVE_NIXL or BY_ID[c].kind != "nixl"]
    out = run_cases(ids, tmp_path_factory.mktemp("frozen"), TIMEOUT)
    for case, survivors in out.items():  # shown with -s: what the load cost each case, beside what is asserted
        timed = [r for r in survivors if r.get("seconds") is not None]
        if timed:
            slowest = max(timed, key=lambda r: r["wall_seconds"])
            print(f"{case}: slowest survivor {slowest['wall_seconds']:.2f} s wall, {slowest['seconds']:.2f} s own")
    return out


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.nixl] if c.startswith("nixl") else [])
                                  for c in CASES])
def test_a_frozen_peer_ends_every_survivor_in_time_naming_the_phase(results, case):
    phase = BY_ID[case]
    if phase.kind == "nixl" and not HAVE_NIXL:
        pytest.skip("nixl is not installed")
    survivors = results[case]
    assert len(survivors) == 2, survivors
    for r in survivors:
        assert "crash" not in r, r["crash"]
        assert r["seconds"] < TIMEOUT + SLACK, f"{case}: process {r['process']} took {r['seconds']:.2f} s of its own ({r})"
        if phase.when == "close":  # bounded clean-up: close does not wait on the frozen peer
            assert r["error"] is None, r
            continue
        assert r["error"] is not None and r["error"].startswith("ExecutionError"), r
        assert r["wall_seconds"] >= TIMEOUT - 0.1 or "failed first" in r["error"], r  # it waited, not failed at once
    if phase.when != "close":
        # the survivor that waits on the victim's step names it; another may have passed that step already (the
        # victim did its part for it) and end at the next wait, the vote: which one is a race
        errors = [r["error"] for r in survivors]
        assert any(re.search(phase.words, e) for e in errors), f"{case}: no error names the phase: {errors}"


def test_every_transport_has_a_row_for_every_phase():
    """A new wait is a new row: each transport lists set-up, a transfer step, the commit vote and close."""
    for kind in ("gloo", "nixl", "shared"):
        names = {p.name for p in PHASES if p.kind == kind}
        assert {"setup", "transfer", "commit", "close"} <= names, (kind, names)

