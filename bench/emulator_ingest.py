"""Emulator ingest benchmark: durable store vs in-memory store, and 100 concurrent SDK connections.

One run, same machine, same client: batch-send 1 KiB messages from one azure-servicebus client to an
emulator child process with the durable SQLite store and to one with the in-memory store, in
alternating rounds, and print both rates and their ratio (goal: durable >= 0.7 x in-memory). Then
open 100 SDK senders at once against the durable emulator and report how many it served together.

    .venv/bin/python bench/emulator_ingest.py [--messages 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode

from spark_sb.emulator import EmulatorProcess, NamespaceOptions
from spark_sb.emulator.server import send_control

BODY = b"x" * 1024


def ingest(conn_str: str, queue: str, count: int) -> float:
    """Messages per second for ``count`` messages sent in full batches by one sender (open excluded)."""
    with ServiceBusClient.from_connection_string(conn_str) as client, client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage(b"warm-up"))
        started = time.perf_counter()
        sent = 0
        while sent < count:
            batch = sender.create_message_batch()
            while sent < count:
                try:
                    batch.add_message(ServiceBusMessage(BODY))
                except ValueError:
                    break
                sent += 1
            sender.send_messages(batch)
        return count / (time.perf_counter() - started)


def count_messages(conn_str: str, queue: str) -> int:
    with ServiceBusClient.from_connection_string(conn_str) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.PEEK_LOCK) as r:
            total, seq = 0, 1
            while True:
                page = r.peek_messages(max_message_count=250, sequence_number=seq)
                if not page:
                    return total
                total += len(page)
                seq = page[-1].sequence_number + 1


def concurrent_connections(conn_str: str, admin_url: str, queue: str, n: int) -> tuple[int, int, float]:
    """Open n SDK senders at once, hold them all open, send one message each. Returns (peak connections
    seen by the emulator, messages accepted, seconds)."""
    clients = [ServiceBusClient.from_connection_string(conn_str) for _ in range(n)]
    senders = [c.get_queue_sender(queue) for c in clients]
    opened = threading.Barrier(n + 1, timeout=120)
    ok = [False] * n

    def work(i: int) -> None:
        senders[i].send_messages(ServiceBusMessage(f"c{i}"))
        ok[i] = True
        opened.wait()  # every sender stays open until all have sent

    started = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    opened.wait()
    peak = send_control(admin_url, "stats")["connections"]
    elapsed = time.perf_counter() - started
    for t in threads:
        t.join()
    for s in senders:
        s.close()
    for c in clients:
        c.close()
    return peak, sum(ok), elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=100)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sb-bench-"))
    entities = work / "entities.yaml"
    entities.write_text("queues:\n" + "".join(f"  - name: q{i}\n" for i in range(args.rounds)) + "  - name: conn\n")
    ns = [NamespaceOptions("bench")]
    durable = EmulatorProcess.start(data_dir=work / "data", namespaces=ns, entities=entities)
    memory = EmulatorProcess.start(data_dir=None, namespaces=ns, entities=entities)
    rates: dict[str, list[float]] = {"durable": [], "memory": []}
    try:
        for r in range(args.rounds):
            for name, emu in (("durable", durable), ("memory", memory)) if r % 2 == 0 else (
                    ("memory", memory), ("durable", durable)):
                rate = ingest(emu["bench"].connection_string, f"q{r}", args.messages)
                rates[name].append(rate)
                print(f"round {r + 1} {name:8s} {rate:10.0f} msg/s", flush=True)
        stored = count_messages(durable["bench"].connection_string, "q0")
        d, m = statistics.median(rates["durable"]), statistics.median(rates["memory"])
        print(f"\nbatch send, 1 KiB messages, one SDK client, {args.messages} per round, median of {args.rounds}:")
        print(f"  durable (SQLite WAL)  {d:10.0f} msg/s")
        print(f"  in-memory             {m:10.0f} msg/s")
        print(f"  ratio durable/memory  {d / m:10.2f}   (goal >= 0.70)")
        print(f"  messages stored in the durable q0: {stored} of {args.messages + 1} sent")
        peak, accepted, secs = concurrent_connections(
            durable["bench"].connection_string, durable["bench"].admin_url, "conn", args.connections)
        print(f"\n{args.connections} concurrent SDK senders: {peak} connections open at once on the emulator, "
              f"{accepted} messages accepted, {secs:.1f} s")
    finally:
        durable.stop()
        memory.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
