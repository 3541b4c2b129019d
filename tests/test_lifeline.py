"""spark_sb.lifeline (issue 34 item 7): a Spark Python process of ours ends when its parent dies; a user's own
interpreter is never watched. The end to end test, a killed syphon job, is tests/spark/test_orphans.py."""

from __future__ import annotations

import os

import pytest

from spark_sb import lifeline


def test_the_process_ends_once_its_parent_changed_and_not_before() -> None:
    parents = iter([40, 40, 40, 1])  # the JVM (pid 40) dies: re-parented to pid 1
    slept: list[float] = []
    exits: list[int] = []
    lifeline._watch(40, 0.5, getppid=lambda: next(parents, 1), sleep=slept.append, exit=exits.append)
    assert slept == [0.5, 0.5, 0.5] and exits == [lifeline.EXIT_STATUS]


def test_a_parent_that_is_pid_1_from_the_start_is_no_death() -> None:
    """A container whose init is the JVM: the parent is pid 1 all along; only a change counts."""
    calls = iter([1, 1, 1, 7])  # then a subreaper takes the process
    exits: list[int] = []
    lifeline._watch(1, 0.1, getppid=lambda: next(calls, 7), sleep=lambda _: None, exit=exits.append)
    assert exits == [lifeline.EXIT_STATUS]


def test_only_a_python_worker_that_spark_started_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lifeline.SPARK_WORKER_MARK, raising=False)
    assert lifeline.watch_parent() is False  # a user's interpreter (a test, a notebook) building a reader
    monkeypatch.setenv(lifeline.SPARK_WORKER_MARK, "secret")
    monkeypatch.setattr(lifeline, "_watch", lambda parent, interval: None)  # this process's parent lives on anyway
    monkeypatch.setattr(lifeline, "_watching_pid", None)
    assert lifeline.watch_parent() is True
    assert lifeline._watching_pid == os.getpid()
    assert lifeline.watch_parent() is True  # once per process
