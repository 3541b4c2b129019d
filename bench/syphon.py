"""Syphon benchmark, one run, one emulator pair (a child process), the same 1 KiB messages.

messages/s moved from a backlog queue to the primary by ``Syphon.move`` over a raw SDK loop that does the same
work without the syphon (receive in peek-lock, send to the destination, complete), goal >= 0.7.

    .venv/bin/python bench/syphon.py [--messages 2000] [--batch 100]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired_send import _free_ports  # noqa: E402

from spark_sb import messages  # noqa: E402
from spark_sb.emulator import EmulatorProcess  # noqa: E402
from spark_sb.paired import PairedSender  # noqa: E402
from spark_sb.syphon import Syphon  # noqa: E402

BODY = b"x" * 1024


def park(conn_str: str, queue: str, entity: str, n: int, tag: str) -> None:
    with ServiceBusClient.from_connection_string(conn_str) as client, client.get_queue_sender(queue) as sender:
        for offset in range(0, n, 200):
            sender.send_messages([messages.to_backlog(ServiceBusMessage(BODY, message_id=f"{tag}-{i}"), entity)
                                  for i in range(offset, min(n, offset + 200))])


def raw_loop(secondary: str, primary: str, queue: str, entity: str, n: int, batch: int) -> float:
    moved = 0
    with ServiceBusClient.from_connection_string(secondary) as s, ServiceBusClient.from_connection_string(primary) as p:
        with s.get_queue_receiver(queue, prefetch_count=0) as receiver, p.get_queue_sender(entity) as sender:
            started = time.perf_counter()
            while moved < n:
                page = receiver.receive_messages(max_message_count=batch, max_wait_time=1)
                if not page:
                    break
                sender.send_messages([ServiceBusMessage(b"".join(m.body), message_id=m.message_id) for m in page])
                for m in page:
                    receiver.complete_message(m)
                moved += len(page)
            return moved / (time.perf_counter() - started)


def syphon_loop(config: dict, queue: str, n: int, batch: int) -> float:
    with Syphon.from_config(config) as syphon:
        started = time.perf_counter()
        moved = 0
        while moved < n:
            summary = syphon.move(queue, batch, max_wait_time=1)
            if not summary.received:
                break
            moved += summary.total_moved
        return moved / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sb-bench-"))
    (work / "entities.yaml").write_text("queues:\n  - name: raw\n  - name: syphon\n")
    emu = EmulatorProcess.start(data_dir=work / "data", entities=work / "entities.yaml", namespaces=_free_ports())
    try:
        p, s = emu["primary"], emu["secondary"]
        config = {
            "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
            "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
            "send_availability": {"backlog_queue_count": 1},
            "syphon": {"receive_batch": args.batch},
        }
        with PairedSender.from_config(config) as sender:
            sender.pair()
            queue = sender.backlog_queues[0]
        park(s.connection_string, queue, "raw", args.messages, "raw")
        raw = raw_loop(s.connection_string, p.connection_string, queue, "raw", args.messages, args.batch)
        park(s.connection_string, queue, "syphon", args.messages, "sy")
        ours = syphon_loop(config, queue, args.messages, args.batch)
    finally:
        emu.stop()
    ratio = ours / raw if raw else 0.0
    print(f"raw SDK receive-send-complete: {raw:,.0f} messages/s")
    print(f"Syphon.move:                   {ours:,.0f} messages/s")
    print(f"ratio {ratio:.2f} (goal >= 0.7): {'met' if ratio >= 0.7 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
