"""One process of the rendezvous tests across two hosts (tests/multihost/test_rendezvous.py), run on a host of the
test bed: `python store_job.py JOB.json ROLE` with ROLE "host" (hosts the refit's store, at the address it finds
itself unless the job names one) or "member" (joins it from the other host). Both then make a gloo group over the
store (reshard's StoreComm, or gloo's own default device with "gloo_default") and all-reduce their process
numbers. Writes what happened, as JSON, to JOB.ROLE.json."""
from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path


def main(job_path: str, role: str) -> None:
    job = json.loads(Path(job_path).read_text())
    out: dict = {"role": role}
    start = time.monotonic()
    try:
        import torch
        import torch.distributed as dist

        from reshard.adapters import rendezvous as rv
        from reshard.executors.collective.comm import StoreComm

        shared = Path(job_path).with_suffix(".rendezvous.json")
        if role == "host":
            rdv, store = rv.host_store(rv.Rendezvous.new(job.get("host"), timeout=job["timeout"]))
            shared.write_text(json.dumps(rdv.to_dict()))
            process = 0
        else:
            deadline = time.monotonic() + 60
            while not shared.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            rdv = rv.Rendezvous.from_dict(json.loads(shared.read_text()))
            start = time.monotonic()
            store = rv.connect(rdv)
            process = 1
        out["address"] = rdv.host
        members = rv.join(store, rdv, process, 2, role)
        out["members"] = {str(k): v["host"] for k, v in members.items()}
        scoped = rv.scoped(store, rdv, "collective")
        if job.get("gloo_default"):  # gloo's own device (the host name): what reshard no longer relies on
            pg = dist.ProcessGroupGloo(scoped, process, 2, timedelta(seconds=job["timeout"]))
            lane = pg
        else:
            comm = StoreComm(scoped, process, 2, "gloo", job["timeout"])
            lane = comm.lanes[0]
        t = torch.tensor([float(process + 1)])
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        lane.allreduce([t], opts).wait()
        out["max"] = float(t[0])
        lane.barrier().wait()  # both have their result before the store's host leaves
    except BaseException as e:  # noqa: BLE001 - the test reads what failed
        out["error"] = f"{type(e).__name__}: {e}"
        out["trace"] = traceback.format_exc()[-3000:]
    out["seconds"] = time.monotonic() - start
    Path(job_path).with_suffix(f".{role}.json").write_text(json.dumps(out))
    sys.stdout.flush()
    import os

    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
