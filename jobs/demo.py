"""The README's main command (`make demo`): the embedded default, end to end, on the local emulator pair.

Starts the emulator pair (primary and secondary namespaces, durable store in a temporary folder) in a
child process, then drives it with the unmodified azure-servicebus SDK: sends to the primary, takes the
primary down with an injected fault, shows what a plain SDK producer sees, heals it, and accounts for
every message at the end. No cloud account, no manual step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode
from azure.servicebus.exceptions import ServiceBusError

from spark_sb.emulator import DEFAULT_NAMESPACES, EmulatorProcess, NamespaceOptions

ENTITIES = """
queues:
  - name: orders
    requires_duplicate_detection: true
    duplicate_detection_history_time_window: 10m
"""


def _say(text: str) -> None:
    print(text, flush=True)


def run(data_dir: Path, batches: int, rows: int, free_ports: bool) -> int:
    entities = data_dir / "entities.yaml"
    entities.write_text(ENTITIES)
    namespaces = [NamespaceOptions(n.name) for n in DEFAULT_NAMESPACES] if free_ports else list(DEFAULT_NAMESPACES)
    _say(f"starting the local Service Bus emulator pair (data in {data_dir / 'emulator'})")
    with EmulatorProcess.start(data_dir=data_dir / "emulator", namespaces=namespaces, entities=entities,
                               log_file=data_dir / "emulator.log") as emu:
        primary = emu["primary"]
        for info in emu.info.values():
            _say(f"  {info.name:9s} amqp://localhost:{info.amqp_port}  admin {info.admin_url}")
        produced, accepted, refused = 0, [], []
        with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as client:
            with client.get_queue_sender("orders") as sender:
                for batch in range(batches):
                    if batch == batches // 3:
                        _say("  >>> injecting fault: primary namespace DOWN")
                        from spark_sb.emulator import fault

                        fault(primary.admin_url, "down")
                    if batch == 2 * batches // 3:
                        from spark_sb.emulator import heal

                        heal(primary.admin_url)
                        _say("  >>> primary healed")
                    ids = [f"row-{batch}-{i}" for i in range(rows)]
                    produced += len(ids)
                    try:
                        sender.send_messages([ServiceBusMessage(f"payload {m}", message_id=m) for m in ids])
                        accepted.extend(ids)
                        _say(f"batch {batch}: {len(ids)} rows -> primary")
                    except ServiceBusError as err:
                        refused.extend(ids)
                        _say(f"batch {batch}: {len(ids)} rows REFUSED by a plain SDK sender "
                             f"({type(err).__name__})")
                        time.sleep(0.2)
            with client.get_queue_receiver("orders", receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
                received: list[str] = []
                while True:
                    page = r.receive_messages(max_message_count=200, max_wait_time=2)
                    if not page:
                        break
                    received.extend(str(m.message_id) for m in page)
        lost = set(accepted) - set(received)
        _say("")
        _say(f"rows produced: {produced}")
        _say(f"in the primary: {len(received)} (accepted by it: {len(accepted)}, lost after acceptance: {len(lost)})")
        _say(f"refused during the outage: {len(refused)}: a plain SDK producer must keep and resend these itself;")
        _say("  the paired sender of spark-sb sends them to backlog queues on the secondary instead.")
        return 0 if not lost and len(received) == len(accepted) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=9)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--default-ports", action="store_true",
                        help="use 5672/5300 and 5673/5301 instead of free ports")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spark-sb-demo-") as tmp:
        return run(Path(tmp), args.batches, args.rows, not args.default_ports)


if __name__ == "__main__":
    sys.exit(main())
