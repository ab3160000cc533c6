"""The rollout side of both integrations' refit loop (`integrations.groups.receive_groups`, used by NeMo-RL's
`receive_weight_batches` and verl's `receive_weights`) when its caller stops taking groups: in process, with the
real agreement over an in-memory store (every group already moved by every process, the trainers' verdict in).

A stop before the last group is handed on fails the refit for every process (their waits see the failure); a stop
while the last group is handed on ("bucket"), or at any group of "model" staging (all handed on after the verdict),
posts nothing: every process has moved and agreed on every group by then, so the others' refits stand, and the
caller that stopped learns of its own failure from its own error. verl's integration of this path, with verl's
manager and a failing server adapter: tests/integration/verl/test_verl_backend.py::
test_an_adapter_failing_on_the_last_group_fails_its_own_update_only; NeMo-RL's ("model" staging, a loader failing
after the verdict): tests/integration/nemo_rl/test_nemo_rl_engine.py::
test_a_refused_stream_fails_every_process_at_once_and_the_next_refit_is_whole.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest
import torch
from torch.distributed import HashStore

from reshard.integrations.agreement import Agreement
from reshard.integrations.groups import receive_groups

GROUPS = 3


def landed(value: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def stop_after(taken: int, bucket: bool) -> tuple[list[tuple[str, int]], str | None, list[int]]:
    """Take `taken` groups, then close the generator at the next yield (as an adapter's error or cancellation does
    once the generator is collected). Returns the failures handed to the `fail` hook (error type, next group), the
    failure the refit's store holds afterwards, and the groups taken."""
    async def run() -> tuple[list[tuple[str, int]], str | None, list[int]]:
        agreement = Agreement(HashStore(), processes=1, trainers=1, groups=GROUPS, timeout=5.0, who="rollout rank 0")
        for k in range(GROUPS):
            agreement.done(k)
        agreement.end()
        failures: list[tuple[str, int]] = []

        def fail(error: BaseException, flight: Any, following: int) -> None:
            failures.append((type(error).__name__, following))
            agreement.fail(error)

        groups = receive_groups(GROUPS, lambda i: landed((i, f"group {i}")), bucket, torch.device("cpu"), agreement,
                                fail, agreed=True)
        took = []
        async for k, _ in groups:
            if len(took) == taken:
                break
            took.append(k)
        await groups.aclose()
        return failures, agreement.failure(), took

    return asyncio.run(run())


@pytest.mark.parametrize("taken", range(GROUPS - 1))
def test_a_stop_before_the_last_group_fails_the_refit_everywhere(taken):
    failures, posted, took = stop_after(taken, bucket=True)
    assert took == list(range(taken))
    # the group after the one already landing is refused, so no process waits in it for this one
    assert failures == [("GeneratorExit", taken + 2)], failures
    assert posted is not None and "rollout rank 0" in posted


@pytest.mark.parametrize("bucket,taken", [(True, GROUPS - 1)] + [(False, t) for t in range(GROUPS)],
                         ids=["bucket-last"] + [f"model-{t}" for t in range(GROUPS)])
def test_a_stop_after_the_verdict_leaves_the_others_refits_standing(bucket, taken):
    failures, posted, took = stop_after(taken, bucket)
    assert took == list(range(taken))
    assert failures == [] and posted is None, (failures, posted)
