"""Closing a namespace's handles (issue 34 item 7): its senders and receivers are closed at once, not one after the
other. Closing an SDK receiver waits for its keep-alive thread (1 s steps) and a few round trips: one after the
other, the receivers of ten backlog queues took about 5 s per namespace, and bench/latency.py's syphon row ended
with "uses still held the secondary namespace's handles after 5 s" although no use held any."""

from __future__ import annotations

import threading

from spark_sb.bus._namespace import _close_handles


class _Link:
    """A sender or receiver whose close() returns only once every other link's close() has started too."""

    def __init__(self, everyone: threading.Barrier, closed: list[_Link]) -> None:
        self.everyone = everyone
        self.closed = closed

    def close(self) -> None:
        self.everyone.wait()
        self.closed.append(self)


def test_a_generations_senders_and_receivers_are_closed_at_once() -> None:
    everyone = threading.Barrier(10, timeout=10)
    closed: list[_Link] = []
    links = [_Link(everyone, closed) for _ in range(10)]
    done = threading.Event()
    _close_handles(links, done)  # one after the other, the first close would wait for the others in vain
    assert done.is_set() and not everyone.broken
    assert sorted(map(id, closed)) == sorted(map(id, links))
