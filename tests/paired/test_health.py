"""The failover timer, pings, probation and the backlog rotation, in logical time only."""

from __future__ import annotations

import random
import threading

import pytest

from spark_sb.bus import EntityState, HealthBoard
from spark_sb.paired.retry import ConstantBackoff, ExponentialBackoff, Retry, RetryFor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def board(clock: Clock, interval: float = 60, ping: float = 60, cooldown: float = 30) -> HealthBoard:
    return HealthBoard(failover_interval=interval, ping_interval=ping, backlog_cooldown=cooldown, clock=clock)


def test_failover_only_when_the_interval_passes_without_success() -> None:
    clock = Clock()
    b = board(clock)
    assert b.record_failure("e") is EntityState.FAILING
    clock.now = 59.9
    assert b.record_failure("e") is EntityState.FAILING
    assert round(b.remaining("e"), 3) == 0.1
    clock.now = 60
    assert b.state("e") is EntityState.FAILED_OVER  # the timer alone decides, even without a new failure


def test_a_success_inside_the_interval_resets_the_timer() -> None:
    clock = Clock()
    b = board(clock)
    b.record_failure("e")
    clock.now = 59
    b.record_success("e")
    assert b.state("e") is EntityState.HEALTHY
    clock.now = 100
    assert b.record_failure("e") is EntityState.FAILING  # a new t0
    clock.now = 159
    assert b.state("e") is EntityState.FAILING


def test_interval_zero_fails_over_on_the_first_outage() -> None:
    b = board(Clock(), interval=0)
    assert b.record_failure("e") is EntityState.FAILED_OVER


def test_entities_are_independent() -> None:
    b = board(Clock(), interval=0)
    b.record_failure("a")
    assert b.state("b") is EntityState.HEALTHY
    assert b.snapshot() == {"a": "failed_over", "b": "healthy"}


def test_one_ping_per_interval_and_probation_after_failback() -> None:
    clock = Clock()
    b = board(clock, interval=60, ping=10)
    b.record_failure("e")
    clock.now = 60
    b.record_failure("e")
    assert not b.claim_ping("e")  # first ping one interval after the failover
    clock.now = 70
    assert b.claim_ping("e") and not b.claim_ping("e")  # exactly one caller pings
    b.ping_result("e", ok=False)
    assert not b.claim_ping("e")
    clock.now = 80
    assert b.claim_ping("e")
    b.ping_result("e", ok=True)
    assert b.state("e") is EntityState.HEALTHY and b.on_probation("e")
    # a failure right after failing back: failed over at once, no new interval
    assert b.record_failure("e") is EntityState.FAILED_OVER
    clock.now = 90
    assert b.claim_ping("e")
    b.ping_result("e", ok=True)
    b.record_success("e")  # the first primary send after failback ends the probation
    assert not b.on_probation("e")
    assert b.record_failure("e") is EntityState.FAILING


def test_claim_ping_is_exclusive_across_threads() -> None:
    clock = Clock()
    b = board(clock, interval=0, ping=1)
    b.record_failure("e")
    clock.now = 5
    wins = []
    threads = [threading.Thread(target=lambda: wins.append(b.claim_ping("e"))) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 1


def test_backlog_choice_is_sticky_and_cooldown_is_shared() -> None:
    clock = Clock()
    b = board(clock, cooldown=30)
    rng = random.Random(7)
    queues = ["q0", "q1", "q2"]
    first = b.backlog_queue("a", queues, rng)
    assert all(b.backlog_queue("a", queues, rng) == first for _ in range(10))
    b.cool_down(first)
    assert b.cooling() == [first]
    for entity in ("a", "b", "c", "d"):
        assert b.backlog_queue(entity, queues, rng) != first
    assert b.backlog_queue("x", queues, rng, exclude=[q for q in queues if q != first]) is None
    clock.now = 30
    assert b.cooling() == []


def test_backoffs_and_retry() -> None:
    assert [ExponentialBackoff(0.5, 4).compute(n) for n in range(1, 6)] == [0.5, 1, 2, 4, 4]
    jittered = ExponentialBackoff(1, 8, jitter=True, rng=random.Random(1))
    assert all(2 <= jittered.compute(3) <= 4 for _ in range(20))
    slept: list[float] = []
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("flaky")
        return "ok"

    assert Retry(ConstantBackoff(2), 3, sleep=slept.append).call(flaky, lambda e: True) == "ok"
    assert slept == [2, 2]


def test_retry_for_rides_out_blips_for_a_time_counted_from_the_first_failure() -> None:
    """The bound the syphon's settlement and the sources' reads share: time since the first failure (work done
    before it, such as waiting for locks, does not use it up), the last wait cut to what is left, then the
    failure itself or what ``give_up`` makes of it; a failure that is not a blip is raised at once."""
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    def busy_after_a_long_wait() -> None:
        if not slept:
            now[0] += 500.0  # e.g. waiting for locks to expire, before the namespace stops answering
        raise TimeoutError("no answer")

    retry = RetryFor(10, ExponentialBackoff(0.5, 5.0), clock=lambda: now[0], sleep=sleep)
    with pytest.raises(TimeoutError):
        retry.call(busy_after_a_long_wait, lambda e: isinstance(e, TimeoutError), what="settling")
    assert slept == [0.5, 1.0, 2.0, 4.0, 2.5]

    def gave_up(exc: Exception, failures: int, elapsed: float) -> RuntimeError:
        return RuntimeError(f"{failures} attempts in {elapsed:g} s")

    slept.clear()
    with pytest.raises(RuntimeError, match="6 attempts in 10 s"):
        retry.call(busy_after_a_long_wait, lambda e: True, what="reading", give_up=gave_up)
    slept.clear()
    with pytest.raises(TimeoutError):
        retry.call(busy_after_a_long_wait, lambda e: False, what="reading")
    assert slept == []


def test_assume_failed_over_starts_in_backlog_mode_with_a_ping_due_at_once() -> None:
    clock = Clock()
    b = board(clock, interval=60, ping=10)
    assert b.assume_failed_over("e") is True
    assert b.state("e") is EntityState.FAILED_OVER  # no failover interval to wait out
    assert b.claim_ping("e") is True  # the first send checks whether the primary is back
    b.ping_result("e", ok=False)
    assert b.state("e") is EntityState.FAILED_OVER
    assert b.assume_failed_over("e") is False  # already failed over: nothing changes
    b.record_success("ok")
    assert b.assume_failed_over("ok") is False  # known healthy in this process: this process decides
    assert b.state("ok") is EntityState.HEALTHY
    assert b.stats() == {"failovers": 0, "failbacks": 0, "assumed_failovers": 1}


def test_stats_count_failovers_and_failbacks() -> None:
    clock = Clock()
    b = board(clock, interval=0, ping=1)
    b.record_failure("e")
    clock.now = 1
    assert b.claim_ping("e")
    b.ping_result("e", ok=True)
    b.record_failure("e")  # on probation: back to failed over at once
    assert b.stats() == {"failovers": 2, "failbacks": 1, "assumed_failovers": 0}


def test_a_failing_state_ends_with_the_last_send_living_through_it() -> None:
    clock = Clock()
    b = board(clock, interval=60)
    with b.sending("e"):
        with b.sending("e"):  # a second send of the same outage
            b.record_failure("e")
        clock.now = 30
        assert b.state("e") is EntityState.FAILING  # one send still lives through it
    assert b.state("e") is EntityState.HEALTHY  # the last one left without success or failover
    clock.now = 10_000
    with b.sending("e"):
        assert b.record_failure("e") is EntityState.FAILING  # a new outage, a new interval
        clock.now = 10_059
        assert b.state("e") is EntityState.FAILING
        clock.now = 10_060
        assert b.state("e") is EntityState.FAILED_OVER
    assert b.state("e") is EntityState.FAILED_OVER  # leaving does not undo a failover


def test_retry_for_waits_at_least_what_a_busy_namespace_asks() -> None:
    """Issue 36: a source riding out a busy namespace waited its own backoff (0.5 s, 1 s, ...) and asked again
    before the service said it would answer; it waits what the service asked now, within the bound."""
    from azure.servicebus.exceptions import ServiceBusServerBusyError

    now, slept = [0.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    def busy() -> None:
        raise ServiceBusServerBusyError(message="The request was terminated because the namespace 'p' is being "
                                                "throttled. Error code : 50002. Please wait 2 seconds and try again.")

    retry = RetryFor(7, ExponentialBackoff(0.5, 5.0), clock=lambda: now[0], sleep=sleep)
    with pytest.raises(ServiceBusServerBusyError):
        retry.call(busy, lambda e: True, what="receiving")
    assert slept == [2.0, 2.0, 2.0, 1.0]  # at least the 2 s asked (then 4 s of backoff would pass the bound)
