"""Syphon benchmark, one run, one emulator pair (a child process), the same 1 KiB messages parked evenly in
two backlog queues.

messages/s moved from the backlog queues to the primary, each over a raw SDK loop that does the same work
without the syphon (receive in peek-lock, send to the destination, complete; one queue after the other):

* ``Syphon.move`` (goal >= 0.9): the syphon's core in one process, queue after queue;
* the syphon job (``jobs/syphon.py``, goal >= 0.7): the ``servicebus-backlog`` source, ``foreachBatch(Republisher)``
  and its Delta ledger on a local Spark session (local[2]), until every message is recorded as delivered.

Each is timed from the end of its first batch, so that opening connections (and starting the query) does not
count for anyone: the rates are steady-state rates. The job's time per step is the mean over the timed
batches: the source's ``latestOffset`` (completing the last batch, taking the batch received ahead), the
foreachBatch (``addBatch``: read and republish, ledger, settle) and Spark's own offset and commit logs.
The last line is ``syphon job ratio: X.XX``.

    .venv/bin/python bench/syphon.py [--messages 12000] [--batch 100] [--per-trigger 4000] [--no-spark]
                                     [--secondary-latency 20ms] [--primary-latency 20ms]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb import messages  # noqa: E402
from spark_sb.durations import parse_seconds  # noqa: E402
from spark_sb.emulator import EmulatorProcess, NamespaceOptions  # noqa: E402
from spark_sb.paired import PairedSender  # noqa: E402
from spark_sb.syphon import Syphon  # noqa: E402

BODY = b"x" * 1024


def park(conn_str: str, queue: str, entity: str, n: int, tag: str) -> None:
    with ServiceBusClient.from_connection_string(conn_str) as client, client.get_queue_sender(queue) as sender:
        for offset in range(0, n, 200):
            sender.send_messages([messages.to_backlog(ServiceBusMessage(BODY, message_id=f"{tag}-{i}"), entity)
                                  for i in range(offset, min(n, offset + 200))])


# Every loop is timed from the end of its first batch to its last, so that no one's connection set-up counts.


def park_evenly(conn_str: str, queues: list[str], entity: str, n: int, tag: str) -> None:
    for index, queue in enumerate(queues):
        park(conn_str, queue, entity, n // len(queues), f"{tag}-{index}")


def raw_loop(secondary: str, primary: str, queues: list[str], entity: str, n: int, batch: int) -> float:
    moved, first, started = 0, 0, 0.0
    with ServiceBusClient.from_connection_string(secondary) as s, ServiceBusClient.from_connection_string(primary) as p:
        with p.get_queue_sender(entity) as sender:
            for queue in queues:
                with s.get_queue_receiver(queue, prefetch_count=0) as receiver:
                    while moved < n:
                        page = receiver.receive_messages(max_message_count=batch, max_wait_time=1)
                        if not page:
                            break
                        sender.send_messages([ServiceBusMessage(b"".join(m.body), message_id=m.message_id)
                                              for m in page])
                        for m in page:
                            receiver.complete_message(m)
                        moved += len(page)
                        if not first:
                            first, started = moved, time.perf_counter()
            return (moved - first) / (time.perf_counter() - started)


def syphon_loop(config: dict, queues: list[str], n: int, batch: int) -> float:
    with Syphon.from_config(config) as syphon:
        moved, first, started = 0, 0, 0.0
        for queue in queues:
            while moved < n:
                summary = syphon.move(queue, batch, max_wait_time=1)
                if not summary.received:
                    break
                moved += summary.total_moved
                if not first:
                    first, started = moved, time.perf_counter()
        return (moved - first) / (time.perf_counter() - started)


STEPS = ("latestOffset", "addBatch", "walCommit", "commitOffsets", "triggerExecution")


def spark_job(config: dict, n: int, per_trigger: int) -> tuple[float, dict[str, float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
    from paired_writer import build_session
    from syphon import start

    spark = build_session("spark-sb-bench-syphon")
    spark.sparkContext.setLogLevel("ERROR")
    query, republisher = start(spark, config, max_per_trigger=per_trigger, receive_timeout=0.5)
    try:
        while not republisher.totals.get("delivered", 0) and query.isActive:  # the first batch
            query.awaitTermination(0.05)
        first, started = republisher.totals.get("delivered", 0), time.perf_counter()
        first_steps = dict(republisher.step_seconds)
        while republisher.totals.get("delivered", 0) < n and query.isActive:
            query.awaitTermination(0.05)
        elapsed = time.perf_counter() - started
        query.awaitTermination(1)  # the last batch's progress
        progress = [p for p in query.recentProgress if p.get("numInputRows")][1:]  # the timed batches
    finally:
        query.stop()
        spark.stop()
    batches = max(1, len(progress))
    steps = {f"spark {name}": sum(p["durationMs"].get(name, 0) for p in progress) / 1000 / batches
             for name in STEPS}
    steps.update({f"foreachBatch {name}": (seconds - first_steps.get(name, 0.0)) / batches
                  for name, seconds in republisher.step_seconds.items()})
    steps["messages per batch"] = sum(p["numInputRows"] for p in progress) / batches
    return (republisher.totals.get("delivered", 0) - first) / elapsed, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=12000, help="over two backlog queues")
    parser.add_argument("--batch", type=int, default=100, help="messages per receive (raw loop, Syphon.move)")
    parser.add_argument("--per-trigger", type=int, default=4000, help="the syphon job's maxMessagesPerTrigger")
    parser.add_argument("--no-spark", action="store_true", help="skip the syphon job")
    parser.add_argument("--secondary-latency", type=parse_seconds, default=0.0, metavar="DURATION",
                        help="the secondary far away: its latency each way (e.g. 20ms: 40 ms round trips)")
    parser.add_argument("--primary-latency", type=parse_seconds, default=0.0, metavar="DURATION",
                        help="the primary far away, as --secondary-latency")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sb-bench-"))
    (work / "entities.yaml").write_text("queues:\n  - name: raw\n  - name: syphon\n  - name: job\n")
    namespaces = [NamespaceOptions("primary", latency=args.primary_latency),
                  NamespaceOptions("secondary", latency=args.secondary_latency)]
    emu = EmulatorProcess.start(data_dir=work / "data", entities=work / "entities.yaml", namespaces=namespaces)
    try:
        p, s = emu["primary"], emu["secondary"]
        config = {
            "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
            "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
            "send_availability": {"backlog_queue_count": 2},
            "syphon": {"receive_batch": args.batch, "retry_interval": "1s",
                       "checkpoint_location": str(work / "checkpoint"), "ledger": str(work / "ledger")},
        }
        with PairedSender.from_config(config) as sender:
            sender.pair()
            queues = list(sender.backlog_queues)
        park_evenly(s.connection_string, queues, "raw", args.messages, "raw")
        raw = raw_loop(s.connection_string, p.connection_string, queues, "raw", args.messages, args.batch)
        park_evenly(s.connection_string, queues, "syphon", args.messages, "sy")
        ours = syphon_loop(config, queues, args.messages, args.batch)
        job, steps = None, {}
        if not args.no_spark:
            park_evenly(s.connection_string, queues, "job", args.messages, "job")
            job, steps = spark_job(config, args.messages, args.per_trigger)
    finally:
        emu.stop()
    print(f"{args.messages} messages of 1 KiB over {len(queues)} backlog queues")
    print(f"raw SDK receive-send-complete: {raw:,.0f} messages/s")
    for name, rate, goal in (("Syphon.move", ours, 0.9), ("the syphon job (Spark)", job, 0.7)):
        if rate is not None:
            ratio = rate / raw if raw else 0.0
            print(f"{name + ':':30s} {rate:,.0f} messages/s, ratio {ratio:.2f} (goal >= {goal}): "
                  f"{'met' if ratio >= goal else 'NOT met'}")
    if steps:
        print("the syphon job, per timed batch:")
        for name, value in steps.items():
            print(f"  {name:34s} {value:8.2f}" + ("" if name == "messages per batch" else " s"))
    if job is not None:
        print(f"syphon job ratio: {job / raw if raw else 0.0:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
