"""The resume rule shared by the gRPC and HTTP fronts (router_service/resume_streak.py), on a fake clock: backoff
doubling within a streak of failures without progress, a new streak after progress, giving up after max_resumes
failures or after wait_s without progress; and how long a call's first event is awaited."""

from __future__ import annotations

from expertmesh.router_service.resume_streak import ResumeStreak


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_within_a_streak_up_to_its_cap():
    streak = ResumeStreak(max_resumes=10, wait_s=1e9, backoff_s=0.1, backoff_max_s=0.5, clock=Clock())
    assert [streak.failed(0) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_progress_starts_a_new_streak_with_the_shortest_backoff():
    clock = Clock()
    streak = ResumeStreak(max_resumes=10, wait_s=5.0, backoff_s=0.1, backoff_max_s=2.0, clock=clock)
    assert streak.failed(3) == 0.1 and streak.failed(3) == 0.2
    clock.now += 4.0
    assert streak.failed(7) == 0.1  # events were relayed since: a new streak
    clock.now += 4.5
    assert streak.failed(7) == 0.2  # 4.5 s into the new streak: still within wait_s
    clock.now += 1.0
    assert streak.failed(7) is None  # 5.5 s without progress: give up


def test_at_most_max_resumes_even_with_progress_each_time():
    streak = ResumeStreak(max_resumes=3, clock=Clock())
    assert [streak.failed(n) is not None for n in range(5)] == [True, True, True, False, False]
    assert streak.failures == 5


def test_the_first_event_waits_unbounded_then_within_the_window_and_the_deadline():
    streak = ResumeStreak(wait_s=60.0, clock=Clock())
    assert streak.first_wait(5.0) is None  # the first attempt: a long prefill or a queue is no failure
    streak.failed(0)
    assert streak.first_wait(None) == 60.0
    assert streak.first_wait(2.5) == 2.5  # the client's deadline comes first
    assert streak.first_wait(-1.0) == 0.0
