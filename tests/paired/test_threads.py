"""Threads sharing one sender while its clients are closed and rebuilt (issue 9, finding 4): closing a client
never pulls it from under a concurrent send."""

from __future__ import annotations

import threading
import time

from azure.servicebus import ServiceBusMessage

from spark_sb.paired import PairedSender


def test_a_connection_error_on_the_primary_never_fails_a_concurrent_backlog_send(
    emulator, make_config, make_queue, secondary_admin
) -> None:
    q = make_queue()
    # the sender's clock runs 5 times faster than real time: a ping (which meets the dropped primary and so
    # closes both sides' clients) every 0.2 s, while two threads keep sending to the one backlog queue
    start = time.monotonic()
    config = make_config(failover_interval="0s", ping_primary_interval="1s", backlog_queue_count=1)
    with PairedSender.from_config(config, clock=lambda: start + 5 * (time.monotonic() - start)) as sender:
        sender.pair()
        emulator.fault("primary", "down")
        sent = []
        errors: list[BaseException] = []
        lock = threading.Lock()
        stop = time.monotonic() + 4

        def work(worker: int) -> None:
            i = 0
            while time.monotonic() < stop:
                try:
                    result = sender.send(q, ServiceBusMessage(f"{worker}-{i}"))
                except Exception as exc:
                    with lock:
                        errors.append(exc)
                else:
                    with lock:
                        sent.append(result.backlog)
                i += 1

        workers = [threading.Thread(target=work, args=(n,)) for n in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        assert sender.state(q) == "failed_over" and sender.stats()["failovers"] >= 1
        assert [f"{type(e).__name__}: {e}" for e in errors[:3]] == [] and len(sent) >= 4
        assert sender.board.cooling() == []  # the healthy secondary never left the rotation
    queue = sender.backlog_queues[0]
    assert secondary_admin.get_queue_runtime_properties(queue).active_message_count == len(sent)
