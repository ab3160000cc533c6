"""No stranger joins a refit: processes that meet at a rendezvous refit through the shared-memory or NIXL
executor over its namespaced store while a process with a wrong secret tries to take a member's place, one
without a secret tries to join, one guesses where the books are, and the public check value was overwritten
before anyone joined. The strangers are refused or find nothing, every refit in progress is byte-identical to
the local executor's, every key the members touch lies under the secret-derived namespace (but the public check
and refusal notes), and the members' shared-memory segments are private (0600) with unguessable names."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from reshard.errors import ExecutionError
from reshard.adapters.rendezvous import Rendezvous, host_store, refused
from harness.faults import context
from harness.strangers import member, stranger, tiny_plan

pytestmark = pytest.mark.fault
REFITS = 5


@pytest.mark.parametrize("kind", ["shared", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_strangers_cannot_join_or_read_and_the_refit_goes_on(tmp_path: Path, kind: str):
    if kind == "nixl":
        pytest.importorskip("nixl")
    tiny_plan(tmp_path / "plan.npz")
    rdv, store = host_store(Rendezvous.new("127.0.0.1", timeout=30.0))
    vandal = dist.TCPStore("127.0.0.1", rdv.port, is_master=False)
    vandal.set(f"reshard/{rdv.refit_id}/check", b"not the check value")  # before any member arrives
    ctx = context()
    d = rdv.to_dict()
    procs = [ctx.Process(target=member, args=(p, d, str(tmp_path), kind, REFITS), daemon=True) for p in (0, 1)]
    procs += [ctx.Process(target=stranger, args=(how, d, str(tmp_path), kind), daemon=True)
              for how in ("wrong", "missing", "reader")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, "a process hung"
    for p in (0, 1):
        r = json.loads((tmp_path / f"result-{p}.json").read_text())
        assert "error" not in r, r["error"]
        assert r["ok"] == [True] * REFITS
        public = (f"reshard/{rdv.refit_id}/check", f"reshard/{rdv.refit_id}/refused")
        outside = [k for k in r["keys"] if not k.startswith(rdv.namespace) and not k.startswith(public)]
        assert not outside, f"process {p} used keys outside the refit's namespace: {outside[:5]}"
    wrong = json.loads((tmp_path / "stranger-wrong.json").read_text())
    assert "joined" not in wrong and "secret" in wrong["refused"] and "refused" in wrong["refused"], wrong
    missing = json.loads((tmp_path / "stranger-missing.json").read_text())
    assert "joined" not in missing and "lacks ['secret']" in missing["refused"], missing
    reader = json.loads((tmp_path / "stranger-reader.json").read_text())
    assert reader.get("found") is False, reader
    assert [x["role"] for x in refused(store, rdv)] == ["stranger"]


def test_a_secret_too_short_or_malformed_is_refused():
    for bad in ("", "short", 12345):
        with pytest.raises(ExecutionError, match="secret"):
            Rendezvous("127.0.0.1", 1, "abc", bad)


def test_segments_are_private_with_unguessable_names():
    from reshard.executors.shared import Segment, shared_empty

    t = shared_empty((16,), torch.float32)
    seg, _ = Segment.holding(t)
    assert re.fullmatch(r"reshard-\d+-\d+-\d+-[0-9a-f]{32}", seg.name)  # creator pid, start time, pid namespace
    assert stat.S_IMODE(os.stat(f"/dev/shm/{seg.name}").st_mode) == 0o600
    for name in ("other-app-segment", "../etc/passwd", f"reshard-{os.getpid()}-abc"):
        with pytest.raises(ExecutionError, match="invalid shared-memory segment name"):
            Segment(name)
    link = f"reshard-{os.getpid()}-{'0' * 32}"
    os.symlink(f"/dev/shm/{seg.name}", f"/dev/shm/{link}")
    try:
        with pytest.raises(ExecutionError, match="cannot open"):
            Segment(link)  # a name that points elsewhere is not followed
    finally:
        os.unlink(f"/dev/shm/{link}")


def test_a_member_waiting_to_join_is_told_when_the_rendezvous_host_goes_away():
    """The host (trainer process 0) closes its store after a failure while another member waits in join: that
    member raises ExecutionError naming the store, not the store's own network error."""
    from reshard.adapters.rendezvous import connect, join

    rdv, store = host_store(Rendezvous.new("127.0.0.1", timeout=30.0))
    member_store = connect(rdv)
    join_error: list[BaseException] = []

    def wait() -> None:
        try:
            join(member_store, rdv, 1, 2, "trainer")  # process 0 never joins: it goes away instead
        except BaseException as e:  # noqa: BLE001 - checked below
            join_error.append(e)

    import threading

    waiter = threading.Thread(target=wait)
    waiter.start()
    del store  # the host's TCPStore server closes
    waiter.join(60)
    assert not waiter.is_alive() and join_error, "the waiting member did not notice the host went away"
    assert isinstance(join_error[0], ExecutionError), repr(join_error[0])
    assert "went away" in str(join_error[0]) and rdv.address in str(join_error[0])
