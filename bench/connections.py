"""Connections one namespace holds (issue 35): the SDK's send and receive with 0, 2,000 and 10,000 idle connections.

Each round starts the emulator in a child process (``EmulatorProcess``, one namespace, in memory, the handshake
timeout off so bare sockets stay, its max-connections above N: Service Bus's own 5,000 would refuse the rest),
opens N bare TCP connections to its AMQP port from this process and holds them, then one SDK client sends 100
messages one at a time and receives and completes them. Prints one Markdown row per N: the seconds to open the N
connections, the connections the namespace reports, and milliseconds per message for the sends and for the receives.
Proton's own select() died at about 1,010; the costs should not grow with N.

    .venv/bin/python bench/connections.py [--counts 0,2000,10000] [--messages 100]
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb.emulator import EmulatorProcess, NamespaceOptions
from spark_sb.emulator.admin_http import CONTROL_HEADER


def _stats(admin_url: str) -> dict:
    req = urllib.request.Request(f"{admin_url}/$emulator/stats", headers={CONTROL_HEADER: "1"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def round_(count: int, messages: int, entities: Path) -> tuple[float, int, float, float]:
    # room for the N idle connections and the SDK client's own (its sender's and its receiver's)
    proc = EmulatorProcess.start(data_dir=None, namespaces=[NamespaceOptions("bench", max_connections=count + 100)],
                                 entities=entities, handshake_timeout=0)
    held: list[socket.socket] = []
    try:
        info = proc["bench"]
        start = time.monotonic()
        for _ in range(count):
            held.append(socket.create_connection(("127.0.0.1", info.amqp_port), timeout=30))
        deadline = time.monotonic() + 60
        while (seen := _stats(info.admin_url)["connections"]) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        opened = time.monotonic() - start
        with ServiceBusClient.from_connection_string(info.connection_string) as client:
            with client.get_queue_sender("orders") as sender:
                sender.send_messages(ServiceBusMessage("warm-up"))
                t0 = time.monotonic()
                for i in range(messages):
                    sender.send_messages(ServiceBusMessage(f"m{i}"))
                send = (time.monotonic() - t0) / messages
            with client.get_queue_receiver("orders", max_wait_time=10) as receiver:
                got = 0
                t0 = time.monotonic()
                while got < messages + 1:
                    batch = receiver.receive_messages(max_message_count=1, max_wait_time=10)
                    if not batch:
                        break
                    for m in batch:
                        receiver.complete_message(m)
                    got += len(batch)
                receive = (time.monotonic() - t0) / got
        assert got == messages + 1, f"received {got} of {messages + 1}"
        assert proc.proc.poll() is None, "the emulator died"
        return opened, seen, send, receive
    finally:
        for s in held:
            s.close()
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="0,2000,10000")
    ap.add_argument("--messages", type=int, default=100)
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max(counts) + 200
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))  # the child inherits it
    entities = Path(tempfile.mkdtemp(prefix="sb-bench-")) / "entities.yaml"
    entities.write_text("queues:\n  - name: orders\n")
    print("| idle connections | opened in (s) | held (emulator's count) | send (ms/msg) | receive+complete (ms/msg) |")
    print("|---:|---:|---:|---:|---:|")
    for count in counts:
        opened, seen, send, receive = round_(count, args.messages, entities)
        print(f"| {count:,} | {opened:.1f} | {seen:,} | {send * 1000:.1f} | {receive * 1000:.1f} |", flush=True)


if __name__ == "__main__":
    main()
