"""A first refit's wait for its peers to leave set-up (executors.exchange.Exchange.wait_set_up), on a real
torch.distributed store shared by threads that play the peers."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from reshard.errors import ExecutionError
from reshard.executors.exchange import Exchange


def _exchange() -> Exchange:
    return Exchange(dist.HashStore(), "ns")


def _later(seconds: float, fn) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    thread.start()
    return thread


def test_returns_once_every_peer_has_left_set_up():
    ex = _exchange()
    ex.leave_setup(1)
    _later(0.3, lambda: ex.leave_setup(2))
    start = time.monotonic()
    ex.wait_set_up([1, 2], version=1, deadline=time.monotonic() + 10, poll_max_s=0.01)
    assert 0.25 < time.monotonic() - start < 5  # it waited for process 2, and no longer than needed


def test_a_peer_still_setting_up_at_the_deadline_is_named():
    ex = _exchange()
    ex.leave_setup(1)
    with pytest.raises(ExecutionError, match=r"process\(es\) \[3\] did not finish setting up"):
        ex.wait_set_up([1, 3], version=1, deadline=time.monotonic() + 0.3, poll_max_s=0.01)


def test_a_failed_set_up_or_refit_stops_the_wait_at_once():
    ex = _exchange()
    _later(0.1, lambda: ex.fail_setup(2, "its agent could not be made"))
    start = time.monotonic()
    with pytest.raises(ExecutionError, match="its agent could not be made"):
        ex.wait_set_up([2], version=1, deadline=time.monotonic() + 20, poll_max_s=0.01)
    assert time.monotonic() - start < 5
    ex = _exchange()
    _later(0.1, lambda: ex.fail(4, "process 0: the trainer died"))
    with pytest.raises(ExecutionError, match="the trainer died"):
        ex.wait_set_up([2], version=4, deadline=time.monotonic() + 20, poll_max_s=0.01)


def test_no_peers_no_wait():
    _exchange().wait_set_up([], version=1, deadline=time.monotonic() - 1, poll_max_s=0.01)
