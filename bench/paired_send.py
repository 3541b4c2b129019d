"""Paired sender benchmark, one run, one emulator pair (a child process), the same 1 KiB messages.

- healthy path: messages/s through PairedSender.send over the raw SDK's batch send (goal >= 0.9)
- failed-over path: PairedSender.send with the primary down (the backlog rewrite, sent to a backlog queue) over
  the raw SDK's batch send of the same messages to that backlog queue (goal >= 0.9, issue 21)
- failover latency, failover_interval 1 s: from the primary going down to the first backlog send (goal <= 1.5 s)
- failback latency, ping_primary_interval 1 s: from the primary healing to the first primary send (goal <= 2 s)
- peak memory of this process over 200,000 messages sent through the paired sender

    .venv/bin/python bench/paired_send.py [--messages 20000] [--rounds 3] [--memory-messages 200000]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb.emulator import EmulatorProcess, fault, heal
from spark_sb.paired import PRIMARY, PairedSender

BODY = b"x" * 1024
CHUNK = 500  # messages per send() call, as a Spark partition would hand them over


def _messages(n: int, tag: str) -> list[ServiceBusMessage]:
    return [ServiceBusMessage(BODY, message_id=f"{tag}-{i}") for i in range(n)]


def raw_sdk(conn_str: str, queue: str, n: int) -> float:
    with ServiceBusClient.from_connection_string(conn_str) as client, client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage(b"warm-up"))
        started = time.perf_counter()
        for offset in range(0, n, CHUNK):
            batch = sender.create_message_batch()
            for m in _messages(min(CHUNK, n - offset), f"raw{offset}"):
                try:
                    batch.add_message(m)
                except ValueError:
                    sender.send_messages(batch)
                    batch = sender.create_message_batch()
                    batch.add_message(m)
            sender.send_messages(batch)
        return n / (time.perf_counter() - started)


def paired(config: dict, queue: str, n: int) -> float:
    with PairedSender.from_config(config) as sender:
        sender.pair()
        sender.send(queue, ServiceBusMessage(b"warm-up"))
        started = time.perf_counter()
        for offset in range(0, n, CHUNK):
            sender.send(queue, _messages(min(CHUNK, n - offset), f"p{offset}"))
        return n / (time.perf_counter() - started)


def failed_over(config: dict, queue: str, n: int, admin_url: str, secondary_conn: str, rounds: int) -> list[tuple[float, float]]:
    """(raw, failed-over paired) rates per round: the primary down, failover interval 0 s, one backlog queue
    (the raw SDK sends to the same queue), rounds alternating which goes first."""
    config = {**config, "send_availability": {**config["send_availability"], "failover_interval": "0s",
                                              "ping_primary_interval": "30m", "backlog_queue_count": 1}}
    out: list[tuple[float, float]] = []
    with PairedSender.from_config(config) as sender:
        sender.pair()
        [backlog] = sender.backlog_queues
        fault(admin_url, "down")
        try:
            assert sender.send(queue, ServiceBusMessage(b"warm-up")).destination == backlog
            for r in range(rounds):
                rates: dict[str, float] = {}
                for name in (("raw", "paired") if r % 2 == 0 else ("paired", "raw")):
                    if name == "raw":
                        rates[name] = raw_sdk(secondary_conn, backlog, n)
                        continue
                    started = time.perf_counter()
                    for offset in range(0, n, CHUNK):
                        sender.send(queue, _messages(min(CHUNK, n - offset), f"f{r}-{offset}"))
                    rates[name] = n / (time.perf_counter() - started)
                out.append((rates["raw"], rates["paired"]))
                print(f"round {r + 1} failed over: raw {rates['raw']:9.0f} msg/s, paired {rates['paired']:9.0f} "
                      "msg/s", flush=True)
        finally:
            heal(admin_url)
    return out


def latencies(config: dict, queue: str, admin_url: str) -> tuple[float, float]:
    """Send one message every 20 ms; take the primary down, wait for the first backlog send; heal, wait for
    the first primary send. Returns (failover latency, failback latency) in seconds."""
    with PairedSender.from_config(config) as sender:
        sender.pair()
        sender.send(queue, ServiceBusMessage(b"warm-up"))
        fault(admin_url, "down")
        down_at = time.monotonic()
        i = 0
        while True:
            i += 1
            result = sender.send(queue, ServiceBusMessage(BODY, message_id=f"fo-{i}"))
            if result.backlog:
                failover = time.monotonic() - down_at
                break
            time.sleep(0.02)
        heal(admin_url)
        healed_at = time.monotonic()
        while True:
            i += 1
            result = sender.send(queue, ServiceBusMessage(BODY, message_id=f"fb-{i}"))
            if result.destination == PRIMARY:
                failback = time.monotonic() - healed_at
                break
            time.sleep(0.02)
    return failover, failback


def peak_memory(config: dict, queue: str, n: int) -> tuple[float, float]:
    """(peak RSS before, peak RSS after) in MiB while sending n messages in chunks, built as they go."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with PairedSender.from_config(config) as sender:
        sender.pair()
        for offset in range(0, n, CHUNK):
            sender.send(queue, _messages(min(CHUNK, n - offset), f"m{offset}"))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return before, after


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-messages", type=int, default=200_000)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sb-bench-"))
    queues = [f"raw{i}" for i in range(args.rounds)] + [f"paired{i}" for i in range(args.rounds)] + ["fo", "lat", "mem"]
    # the memory run stores 200 MiB of messages: give its queue room
    entities = "queues:\n" + "".join(f"  - name: {q}\n    max_size_in_megabytes: 5120\n" for q in queues)
    (work / "entities.yaml").write_text(entities)
    emu = EmulatorProcess.start(data_dir=work / "data", entities=work / "entities.yaml",
                                namespaces=_free_ports())
    try:
        p, s = emu["primary"], emu["secondary"]
        base = {
            "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
            "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
            "send_availability": {"backlog_queue_count": 2, "failover_interval": "1s", "ping_primary_interval": "1s"},
        }
        rates: dict[str, list[float]] = {"raw": [], "paired": []}
        for r in range(args.rounds):
            order = [("raw", raw_sdk), ("paired", None)] if r % 2 == 0 else [("paired", None), ("raw", raw_sdk)]
            for name, _ in order:
                if name == "raw":
                    rate = raw_sdk(p.connection_string, f"raw{r}", args.messages)
                else:
                    rate = paired(base, f"paired{r}", args.messages)
                rates[name].append(rate)
                print(f"round {r + 1} {name:6s} {rate:9.0f} msg/s", flush=True)
        raw, pair = statistics.median(rates["raw"]), statistics.median(rates["paired"])
        fo = failed_over(base, "fo", args.messages, p.admin_url, s.connection_string, args.rounds)
        fo_raw, fo_pair = statistics.median(r for r, _ in fo), statistics.median(f for _, f in fo)
        failover, failback = latencies(base, "lat", p.admin_url)
        before, after = peak_memory(base, "mem", args.memory_messages)
        print(f"\nhealthy path, {args.messages} x 1 KiB messages, chunks of {CHUNK}, median of {args.rounds}:")
        print(f"  raw SDK batch send     {raw:9.0f} msg/s")
        print(f"  PairedSender.send      {pair:9.0f} msg/s")
        print(f"  ratio paired/raw       {pair / raw:9.2f}   (goal >= 0.90)")
        print(f"failed-over path (primary down), same messages, median of {args.rounds}:")
        print(f"  raw SDK batch send to the backlog queue  {fo_raw:9.0f} msg/s")
        print(f"  PairedSender.send, failed over           {fo_pair:9.0f} msg/s")
        print(f"  ratio failed-over/raw                    {fo_pair / fo_raw:9.2f}   (goal >= 0.90)")
        print(f"failover latency, interval 1 s      {failover:6.2f} s   (goal <= 1.5 s)")
        print(f"failback latency, ping interval 1 s {failback:6.2f} s   (goal <= 2 s)")
        print(f"peak RSS over {args.memory_messages} messages: {after:.0f} MiB (before: {before:.0f} MiB, "
              f"growth {after - before:.0f} MiB)")
    finally:
        emu.stop()
    return 0


def _free_ports() -> list:
    from spark_sb.emulator import NamespaceOptions

    return [NamespaceOptions("primary"), NamespaceOptions("secondary")]


if __name__ == "__main__":
    sys.exit(main())
