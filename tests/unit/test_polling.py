"""reshard.polling.poll on a fake clock: the answer, the deadline, the doubling sleeps and an early stop."""
from __future__ import annotations

import pytest

from reshard import polling
from reshard.errors import ExecutionError


class FakeClock:
    def __init__(self) -> None:
        self.now, self.sleeps = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(polling, "time", fake)
    return fake


def test_true_once_done_with_doubling_sleeps_up_to_the_most(clock: FakeClock) -> None:
    calls = iter([False] * 6 + [True])
    assert polling.poll(lambda: next(calls), deadline=200.0, first_s=0.01, most_s=0.05)
    assert clock.sleeps == pytest.approx([0.01, 0.02, 0.04, 0.05, 0.05, 0.05])


def test_done_at_once_never_sleeps(clock: FakeClock) -> None:
    assert polling.poll(lambda: True, deadline=0.0)  # even past the deadline: the condition is asked first
    assert clock.sleeps == []


def test_false_at_the_deadline_without_sleeping_past_it(clock: FakeClock) -> None:
    assert not polling.poll(lambda: False, deadline=clock.now + 1.0, first_s=0.3, most_s=0.3)
    assert clock.now == pytest.approx(101.0)  # the last sleep is cut to the deadline
    assert clock.sleeps[-1] == pytest.approx(0.1)


def test_between_runs_before_each_sleep_and_stops_by_raising(clock: FakeClock) -> None:
    seen = []

    def between() -> None:
        seen.append(clock.now)
        if len(seen) == 3:
            raise ExecutionError("a peer failed")

    with pytest.raises(ExecutionError, match="a peer failed"):
        polling.poll(lambda: False, deadline=200.0, first_s=1.0, most_s=1.0, between=between)
    assert seen == [100.0, 101.0, 102.0] and len(clock.sleeps) == 2
