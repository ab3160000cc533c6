"""The trainers follow an EPLB engine's expert placement: a rebalance between refits recompiles the plan before any
byte moves. Imports no vLLM.

An engine refuses a plan of another placement and reports the one it holds (`report`); in the refit's agreement
step (`agree`) trainer process 0 reads the reports and decides, the others wait for its decision; `follow`
recompiles the destination (`RefitSpec.with_expert_placement`), meets the engines again and reruns the step,
logging each follow into `TrainerSession.followed`. Reports and decisions travel through the rendezvous store,
under the generation's scope (in-process refits: this process):

    replica/<k>     JSON of engine replica k's placement
    decision/<n>    process 0's decision on step n: "go", "fail", or the JSON of the placement to follow
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, TypeVar

from ..errors import ExecutionError
from ..layouts.expert_placement import ExpertPlacement
from ..polling import poll
from . import rendezvous as rv

MOST_FOLLOWS = 2  # rebalances followed within one step: EPLB rebalances every few thousand forward steps
log = logging.getLogger("reshard.trainer")
_IN_PROCESS: dict[tuple[str, int], ExpertPlacement] = {}  # (publication key, replica) -> reported placement
T = TypeVar("T")


def _scope(refit: Any, store: Any) -> Any:
    rdv = rv.Rendezvous.from_dict(refit.rendezvous)
    return rv.scoped(store if store is not None else rv.connect(rdv), rdv, "placement")


def report(refit: Any, store: Any, placement: ExpertPlacement) -> None:
    """Engine side: tell the trainers the placement engine replica `refit.replica` holds (best effort).

    `store` is the refit's store, or None (connected here for a cross-process refit).
    """
    try:
        if refit.cross_process and refit.rendezvous is not None:
            _scope(refit, store).set(f"replica/{refit.replica}", placement.model_dump_json())
        else:
            _IN_PROCESS[(str(refit.options.get("key", "default")), refit.replica)] = placement
    except Exception as e:  # noqa: BLE001 - the refusal still stops the refit; only the follow is lost
        log.warning("could not report engine replica %d's expert placement: %s", refit.replica, e)


def _reported(session: Any) -> ExpertPlacement | None:
    """Process 0: the placement the engines reported, if it is not the plan's (ExecutionError: they differ)."""
    refit = session.refit_spec
    dst = refit.layouts()[1]
    if refit.cross_process:
        if session.store is None or refit.rendezvous is None:
            return None
        keys = _scope(refit, session.store)
        got = {k: keys.get(f"replica/{k}") for k in range(dst.num_replicas) if keys.check([f"replica/{k}"])}
        got = {k: ExpertPlacement.model_validate_json(v) for k, v in got.items()}
    else:
        key = str(refit.options.get("key", "default"))
        got = {k: _IN_PROCESS.pop((key, k)) for k in range(dst.num_replicas) if (key, k) in _IN_PROCESS}
    changed = {k: p for k, p in got.items() if p != dst.experts}
    if len(set(changed.values())) > 1:
        raise ExecutionError("the engines' EPLB states hold different expert placements (" + "; ".join(
            f"replica {k}: {p.digest[:12]}" for k, p in sorted(changed.items())) + "): one refit's destination "
            "layout has one placement; refit each engine with its own RefitSpec")
    return next(iter(changed.values()), None)


def agree(session: Any, step: str, errors: list[str], deadline: float) -> list[str]:
    """One step's placement agreement (`step`: "init" or the refit's number), on every trainer process.

    Process 0 decides from the engines' reports (its `errors`: what the engines said), the others wait for its
    decision before any byte moves. Sets `session.to_follow` to a placement the plan was not compiled for.

    Returns:
        `errors`, plus why this process stops here (another process's failure, or the placement to follow).
    """
    session.to_follow = None
    refit = session.refit_spec
    if refit.install == "loader" or getattr(refit.layouts()[1], "experts", None) is None:
        return errors  # only an expert-parallel destination, not a loader install, follows the engines' placement
    shared = refit.cross_process and session.store is not None and refit.rendezvous is not None
    if session.process == 0:
        try:
            new = _reported(session) if errors else None
        except ExecutionError as e:
            new, errors = None, [*errors, str(e)]
        decision = new.model_dump_json() if new is not None else ("fail" if errors else "go")
        if shared:
            _scope(refit, session.store).set(f"decision/{step}", decision)
    elif not shared:
        return errors
    else:
        keys = _scope(refit, session.store)
        if not poll(lambda: keys.check([f"decision/{step}"]), deadline, first_s=1e-4, most_s=0.01):
            return [*errors, f"trainer process {session.process}: no word from trainer process 0 on the engines' "
                             f"start within the refit's deadline"]
        decision = keys.get(f"decision/{step}").decode()
        new = None if decision in ("go", "fail") else ExpertPlacement.model_validate_json(decision)
        if decision == "fail":
            errors = [*errors, f"trainer process {session.process}: trainer process 0 reported that the engines "
                               f"refused the refit"]
    if new is not None:
        session.to_follow = new
        errors = [*errors, f"the engines' expert placement is {new.digest[:12]}, not the plan's: recompiling"]
    return errors


def follow(session: Any, step: Callable[[], T], name: str) -> T:
    """Run `step` (the session's init, or one refit) on every trainer process, following the engines' placement.

    Where the engines refused it for their placement (`agree` set `session.to_follow`), recompile for it, meet the
    engines again and rerun `step`, at most MOST_FOLLOWS times; each follow is logged into `session.followed`.

    Raises:
        ExecutionError: what `step` raised, where nothing is to follow (or the placement moved too often).
    """
    at_init = name == "init"
    for attempt in range(MOST_FOLLOWS + 1):
        session.to_follow = None
        try:
            result = step()
        except ExecutionError as e:
            if at_init:  # every process waits for process 0's word (its own step failed: it may be a placement)
                agree(session, "init", [str(e)], time.monotonic() + session.timeout)
            if session.to_follow is None or attempt == MOST_FOLLOWS:
                raise
        else:
            if at_init and session.process == 0:  # "go" for a process whose own init failed for another reason
                agree(session, "init", [], time.monotonic() + session.timeout)
            return result
        start, new = time.perf_counter(), session.to_follow
        old = session.refit_spec.layouts()[1].experts
        session.refit_spec = session.refit_spec.with_expert_placement(new)
        session.refit_spec.plan()  # the recompile (only the destination changed: the source's tables are cached)
        if not at_init:
            session.init()  # the engines bind the recompiled plan (following again if they moved meanwhile)
        note = {"step": name, "from": old.digest if old is not None else "", "to": new.digest,
                "why": "the engines' EPLB state moved experts since the plan was compiled",
                "seconds": round(time.perf_counter() - start, 3)}
        session.followed.append(note)
        log.warning("reshard %s: expert placement %s -> %s (%s): the plan was recompiled for it%s in %.3f s, before "
                    "any byte moved", name, note["from"][:12], note["to"][:12], note["why"],
                    "" if at_init else " and the engines met again", note["seconds"])
    raise AssertionError("unreachable")


__all__ = ["MOST_FOLLOWS", "agree", "follow", "report"]
