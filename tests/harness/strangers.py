"""Processes that meet at a rendezvous (adapters.rendezvous) while strangers try to join or read: members run a
refit after refit through the shared-memory or NIXL executor over the rendezvous's namespaced store, recording
every key they touch; strangers present a wrong secret, no secret, or guess where the books are."""
from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SENTINEL = -7.0


class Recording(dist.Store):
    """A store that passes every call to `inner` and remembers the keys it was asked about."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.keys = inner, set()

    def set(self, key: str, value: Any) -> None:
        self.keys.add(key)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.keys.add(key)
        return self.inner.get(key)

    def add(self, key: str, n: int) -> int:
        self.keys.add(key)
        return self.inner.add(key, n)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.keys.add(key)
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self.keys.update(keys)
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.keys.update(keys)
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self.keys.add(key)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()


def tiny_plan(path: Path) -> Path:
    import reshard

    spec = reshard.ModelSpec(family="qwen3", hidden_size=32, num_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=100, qk_norm=True)
    return reshard.compile(reshard.MegatronLayout(model=spec, tp=1), reshard.VllmLayout(model=spec)).save(path)


def member(process: int, rdv: dict, workdir: str, kind: str, refits: int) -> None:
    """Join as process `process` of 2, then refit `refits` times; write result-<process>.json."""
    from reshard.executors.binding import Binding
    from reshard.executors.reference import allocate, execute_local, shard
    from reshard.adapters.rendezvous import Rendezvous, connect, join, scoped
    from reshard.planner import Plan
    from .faults import _weights

    torch.set_num_threads(1)
    r = Rendezvous.from_dict(rdv)
    store = Recording(connect(r))
    out: dict[str, Any] = {"process": process, "ok": []}
    try:
        join(store, r, process, 2, "member")
        plan = Plan.load(Path(workdir) / "plan.npz")
        binding = Binding((0,), (1,))
        src = shard(plan.src, _weights(plan.src.model, 0), ranks=list(binding.src_ranks_of(process)))
        dst = allocate(plan.dst, fill=SENTINEL, ranks=list(binding.dst_ranks_of(process)))
        ex_store = scoped(store, r, kind)
        if kind == "nixl":
            from reshard.executors.nixl import NixlExecutor, NixlOptions

            ex = NixlExecutor(plan, binding, process, src, dst, store=ex_store, namespace=r.refit_id,
                              options=NixlOptions(timeout=30.0, checksum=True))
        else:
            from reshard.executors.shared import SharedExecutor

            ex = SharedExecutor(plan, binding, process, src, dst, store=ex_store, namespace=r.refit_id,
                                timeout=30.0, checksum=True)
        for k in range(refits):
            full = shard(plan.src, _weights(plan.src.model, k + 1))
            for rank, ts in src.items():
                for n, t in ts.items():
                    t.copy_(full[rank][n])
            ex.refit()
            want = allocate(plan.dst, fill=SENTINEL)
            execute_local(plan, full, want)
            out["ok"].append(all(torch.equal(t, want[rank][n]) for rank, ts in dst.items() for n, t in ts.items()))
        ex.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    out["keys"] = sorted(store.keys)
    (Path(workdir) / f"result-{process}.json").write_text(json.dumps(out))


def stranger(how: str, rdv: dict, workdir: str, kind: str) -> None:
    """Try to join or read the refit without its secret; write stranger-<how>.json with what happened."""
    from reshard.errors import ReshardError
    from reshard.adapters.rendezvous import Rendezvous, connect, join, scoped

    out: dict[str, Any] = {"how": how}
    try:
        if how == "missing":
            Rendezvous.from_dict({k: v for k, v in rdv.items() if k != "secret"})
            out["joined"] = True
        else:
            wrong = Rendezvous(rdv["host"], rdv["port"], rdv["refit_id"], "0" * 32, 5.0)
            store = connect(wrong)
            if how == "wrong":
                join(store, wrong, 0, 2, "stranger")  # take a member's place with a wrong secret
                out["joined"] = True
            else:  # a reader: where would the books be? under its own namespace, or under none
                guesses = [f"reshard-{kind}/{rdv['refit_id']}/book/{p}" for p in (0, 1)]
                guesses += [f"reshard/{rdv['refit_id']}/member/{p}" for p in (0, 1)]
                found = any(store.check([g]) for g in guesses)
                mine = scoped(store, wrong, kind)
                found = found or any(mine.check([f"reshard-{kind}/{rdv['refit_id']}/book/{p}"]) for p in (0, 1))
                try:  # a blocking read of a book it guessed
                    mine.wait([f"reshard-{kind}/{rdv['refit_id']}/md/0"], timedelta(seconds=1.0))
                    found = True
                except Exception:  # noqa: BLE001 - the expected outcome: nothing there
                    pass
                out["found"] = found
    except ReshardError as e:
        out["refused"] = f"{type(e).__name__}: {e}"
    (Path(workdir) / f"stranger-{how}.json").write_text(json.dumps(out))


__all__ = ["Recording", "member", "stranger", "tiny_plan"]
