"""CPU per message of the send path (issue 50): the sending process's user+system CPU per message, from the rows
(an Arrow batch, as ``mapInArrow`` hands a partition over) to the acknowledged send, each path over the raw SDK's on
the same emulator (its own process) in one run.

Messages carry a message id, a subject and three application properties of different types (a string, a long and a
double); bodies of 1 KiB, and a variant of 100 bytes. Paths:

* **raw SDK**: the rows to ``ServiceBusMessage``s, added to ``ServiceBusMessageBatch``es, ``send_messages`` (the
  denominator);
* **sink, healthy**: the sink's partition run (``PartitionRun``, what each executor runs inside ``mapInArrow``);
* **sink, failed over**: the same with its entity failed over (the backlog rewrite, sent to the backlog queue);
* **sink, active replication**: the same in active mode (every message to both namespaces);
* **syphon republish**: the syphon's restore-and-republish of messages read from a backlog queue
  (``republish_received``: the receive is not counted, the restore and the send are).

Rounds alternate the order of the paths; each figure is the median of the rounds. Prints a Markdown table.

    .venv/bin/python bench/cpu.py [--messages 6000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode
from latency import fail_back  # bench/, the script's directory

from spark_sb import sink as sink_module
from spark_sb.config import load_config
from spark_sb.emulator import EmulatorProcess, fault, heal
from spark_sb.syphon import republish_received

QUEUE = "orders"
CHUNK = 200
TYPES = {"region": "string", "quantity": "long", "price": "double"}


def rows(n: int, body_size: int) -> list[pa.RecordBatch]:
    """``n`` rows as the sink's columns, in Arrow batches of 10,000."""
    tag = uuid.uuid4().hex[:8]
    body = b"x" * body_size
    out = []
    for start in range(0, n, 10_000):
        ids = range(start, min(start + 10_000, n))
        out.append(pa.RecordBatch.from_pydict({
            "body": [body] * len(ids),
            "message_id": [f"cpu-{tag}-{i}" for i in ids],
            "subject": ["order-created"] * len(ids),
            "application_properties": pa.array(
                [[("region", f"region-{i % 7}"), ("quantity", str(i)), ("price", f"{i * 1.5}")] for i in ids],
                type=pa.map_(pa.string(), pa.string())),
            "application_property_types": pa.array([list(TYPES.items())] * len(ids),
                                                   type=pa.map_(pa.string(), pa.string())),
        }))
    return out


def cpu(work: Callable[[], int]) -> float:
    """CPU seconds per message of ``work`` (which returns the messages it sent), in this process (the garbage of
    the path before collected first: not charged to this one)."""
    gc.collect()
    started = time.process_time()
    n = work()
    return (time.process_time() - started) / n


def raw_sdk(conn_str: str, batches: list[pa.RecordBatch]) -> int:
    from spark_sb.messages import property_value

    n = 0
    with ServiceBusClient.from_connection_string(conn_str) as client, \
            client.get_queue_sender(QUEUE, keep_alive=0) as sender:
        for record in batches:
            columns = {name: record.column(name).to_pylist() for name in record.schema.names}
            values = list(zip(*columns.values(), strict=True))
            for offset in range(0, len(values), CHUNK):
                batch = sender.create_message_batch()
                for body, message_id, subject, props, types in values[offset:offset + CHUNK]:
                    kinds = dict(types)
                    batch.add_message(ServiceBusMessage(
                        body, message_id=message_id, subject=subject,
                        application_properties={k: property_value(k, v, kinds[k]) for k, v in props}))
                sender.send_messages(batch)
                n += len(batch)
    return n


def partition(config: Any, batches: list[pa.RecordBatch], failed_over: tuple[str, ...] = ()) -> int:
    """Send ``batches`` through a partition run; every row must reach the primary (to the backlog when
    ``failed_over``): a path measured is the path named."""
    run = sink_module.PartitionRun(config, config.fingerprint(), 1, 0, failed_over, reject=False)
    summary = list(run.run(iter(batches)))[-1].to_pylist()[0]
    expected = sum(b.num_rows for b in batches)
    where = sum(n for _, n in summary["backlog"]) if failed_over else summary["primary"]
    if summary["sent"] != expected or where != expected:
        raise RuntimeError(f"the partition run sent {summary['sent']} of {expected}, "
                           f"{where} to the {'backlog' if failed_over else 'primary'}")
    return expected


@contextlib.contextmanager
def primary_down(admin: str) -> Iterator[None]:
    fault(admin, "down")
    try:
        yield
    finally:
        heal(admin)


def config_for(emu: EmulatorProcess, **replication: Any) -> Any:
    p, s = emu["primary"], emu["secondary"]
    return load_config({
        "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
        "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
        "send_availability": {"backlog_queue_count": 1, "failover_interval": "0s", "ping_primary_interval": "30m"},
        "sink": {"entity": QUEUE, "chunk_size": CHUNK},
        **({"replication": replication} if replication else {}),
    })


def republish(config: Any, admin: str, secondary: str, backlog: str, n: int) -> Callable[[], int]:
    """Park ``n`` messages (not timed), read them, then the timed part: restore and republish them."""
    received: list[Any] = []

    def park_and_read() -> None:
        sink_module.close_senders()
        with primary_down(admin):
            partition(config, rows(n, 1024), (QUEUE,))
        fail_back()
        with ServiceBusClient.from_connection_string(secondary) as c, \
                c.get_queue_receiver(backlog, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            while len(received) < n:
                page = receiver.receive_messages(max_message_count=500, max_wait_time=5)
                if not page:
                    raise RuntimeError(f"read {len(received)} of {n} parked messages")
                received.extend(page)
            received.extend(receiver.receive_messages(max_message_count=10_000, max_wait_time=1))
        sink_module.close_senders()

    def timed() -> int:
        outcomes = republish_received(config, {backlog: received})
        moved = sum(1 for o in outcomes if o.outcome == "delivered")
        if moved != len(received):  # the failed-over path's messages too, when it ran before
            raise RuntimeError(f"the syphon moved {moved} of {len(received)}: {outcomes[:1]}")
        received.clear()
        return moved

    timed.prepare = park_and_read  # type: ignore[attr-defined]
    return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sb-bench-cpu-"))
    entities = work / "entities.yaml"
    entities.write_text(f"queues:\n  - name: {QUEUE}\n    max_size_in_megabytes: 5120\n")
    emu = EmulatorProcess.start(data_dir=work / "data", entities=entities)
    table: list[tuple[str, float, float]] = []
    try:
        healthy, active = config_for(emu), config_for(emu, mode="active")
        sender = sink_module.sender_for(healthy)
        sender.pair()
        [backlog] = sender.backlog_queues
        conn = emu["primary"].connection_string
        for size in (1024, 100):
            data = rows(args.messages, size)
            partition(healthy, rows(200, size))  # every connection open before the clock
            paths: dict[str, Callable[[], int]] = {
                "raw SDK": lambda data=data: raw_sdk(conn, data),
                "sink, healthy": lambda data=data: partition(healthy, data),
                "sink, failed over": lambda data=data: partition(healthy, data, (QUEUE,)),
                "sink, active replication": lambda data=data: partition(active, data),
            }
            if size == 1024:
                paths["syphon republish"] = republish(healthy, emu["primary"].admin_url, emu["secondary"].connection_string, backlog, args.messages)
            figures: dict[str, list[float]] = {name: [] for name in paths}
            for r in range(args.rounds):
                order = list(paths) if r % 2 == 0 else list(reversed(paths))
                for name in order:
                    prepare = getattr(paths[name], "prepare", None)
                    if prepare is not None:
                        prepare()
                    if name == "sink, failed over":  # the primary down: the entity stays failed over
                        with primary_down(emu["primary"].admin_url):
                            figures[name].append(cpu(paths[name]))
                        fail_back()  # healthy again for the next path
                    else:
                        figures[name].append(cpu(paths[name]))
                print(f"round {r + 1} ({size} B): " + ", ".join(
                    f"{name} {figures[name][-1] * 1e6:.0f} µs" for name in paths), file=sys.stderr, flush=True)
            raw = statistics.median(figures["raw SDK"])
            for name in paths:
                table.append((f"{name}, {size} B bodies", raw, statistics.median(figures[name])))
    finally:
        sink_module.close_senders()
        emu.stop()
    print(f"\n{args.messages} messages a path, chunks of {CHUNK}, median of {args.rounds} rounds; the sending "
          "process's user+system CPU (the emulator in its own process)\n")
    print("| path | CPU per message | of the raw SDK's |")
    print("| --- | ---: | ---: |")
    for what, raw, ours in table:
        print(f"| {what} | {ours * 1e6:.0f} µs | {ours / raw:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
