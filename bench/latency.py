"""The outage path at full speed (issue 21): far namespaces, one table of ratios, each against the raw SDK sending
sequentially (one batch, then its acknowledgement, then the next) on the same emulator with the same latency.

A namespace "N ms away" is an emulator namespace with ``latency=N/2`` (every byte delayed that long each way,
:mod:`spark_sb.emulator.relay`): a round trip costs N ms. Messages are 1 KiB, in chunks of 500 as a Spark
partition hands them to the sender.

Rows:

* **sink failed over, loopback / secondary 40 ms away**: the sink's partition run (``PartitionRun``, what each
  executor runs inside ``mapInArrow``; no Spark scheduling in the timing) with the primary down and its entity
  failed over, over the raw SDK's sequential batch send of the same messages to the backlog queue;
* **sink healthy, loopback / primary 5 ms away**: the same run to a healthy primary, over the raw SDK's sequential
  send to the primary entity;
* **syphon job, secondary 40 ms away**: ``jobs/syphon.py``'s query on a local Spark session moving messages
  parked over ten backlog queues (the default count) home, over bench/syphon.py's raw loop (receive a page, send
  it, complete each message: one round trip per message to the far secondary);
* **8 sends in flight of pre-built batches, secondary 40 ms away**: threads sending batches built before the
  clock through ``Namespace.send``, all on one link, over the same with a connection each (no rows, no encoding
  timed: what sharing the link costs; issue 47's goal 0.9);
* **sink healthy, loopback, one connection per entity**: the partition run with its ``sends_in_flight`` sends
  sharing one connection per entity (the default, ``connections_per_entity: 1``), over the same run with a
  connection per send in flight (``connections_per_entity`` = ``sends_in_flight``, as the sink sent before);
* **active replication, secondary 40 ms away**: the partition run in active mode (both namespaces), over the raw
  SDK's sequential send to the primary; its ratio to the paired run on the same emulator is printed too.

Sessions (issue 38, :mod:`spark_sb.paired.sessions`): the same runs with every message in one of
``--sessions`` sessions (12; row ``i`` in session ``i % 12``, each session's rows in order) to ``orders-sessions``,
a queue that requires sessions, with four backlog queues (provisioned, so that a session's message peeks them);
the goal column gives the ratio to the row without sessions beside it. The sink sends a chunk that holds a
session's messages after every chunk in flight (one at a time), so these rows show that cost too.

* **sink healthy with sessions, nothing parked, primary 5 ms away**: each partition peeks every backlog queue
  once (the clock starts after the run's ``new_batch``), then sends to the primary; over the raw SDK's sequential
  send of the same session messages to the primary;
* **sink healthy with sessions, other messages parked** (``--others-parked N``, issue 48: 5,000): as the row
  above, with ``N`` messages of another entity parked in each backlog queue; its goal column also gives what a
  partition's first session send costs more than without them (goal: under 0.2 s), after the process's first
  question (a new worker reads the backlog queues once);
* **sink failed over with sessions**: each session's messages go to the backlog queue its id hashes to; over the
  raw SDK's sequential send to a backlog queue;
* **sink following with sessions**: the primary healthy, but every session has one message parked (by the same
  sender while its entity was failed over; the backlog emptied and parked again before each round): each partition
  peeks the backlog queues and sends every message behind its session's parked one, to the backlog; over the raw
  SDK's sequential send to a backlog queue.

Rounds alternate which side goes first; each rate is the median of the rounds. Prints a Markdown table.

    .venv/bin/python bench/latency.py [--messages 12000] [--rounds 3] [--in-flight 8] [--syphon-messages 1200]
                                      [--no-spark] [--sessions 12] [--others-parked 5000]
    .venv/bin/python bench/latency.py --quick    # make bench-quick: the rows a send-path change reports
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb import sink as sink_module
from spark_sb.bus import all_boards
from spark_sb.config import load_config
from spark_sb.emulator import EmulatorProcess, NamespaceOptions, fault, heal

BODY = b"x" * 1024
CHUNK = 500
QUEUE = "orders"
SESSION_QUEUE = "orders-sessions"  # requires sessions


def raw_sequential(conn_str: str, queue: str, n: int, sessions: int = 0) -> float:
    """Messages/s of the raw SDK: build each chunk's messages, send its batches one after the other (message
    ``i`` in session ``i % sessions`` when ``sessions``)."""
    with ServiceBusClient.from_connection_string(conn_str) as client, \
            client.get_queue_sender(queue, keep_alive=0) as sender:
        sender.send_messages(ServiceBusMessage(b"warm-up", session_id="warm-up" if sessions else None))
        tag = uuid.uuid4().hex[:8]
        started = time.perf_counter()
        for offset in range(0, n, CHUNK):
            batch = sender.create_message_batch()
            for i in range(offset, min(offset + CHUNK, n)):
                message = ServiceBusMessage(BODY, message_id=f"raw-{tag}-{i}",
                                            session_id=_session(i, sessions) if sessions else None)
                try:
                    batch.add_message(message)
                except ValueError:
                    sender.send_messages(batch)
                    batch = sender.create_message_batch()
                    batch.add_message(message)
            sender.send_messages(batch)
        return n / (time.perf_counter() - started)


def _session(i: int, sessions: int) -> str:
    return f"session-{i % sessions:02d}"


class _Warm(list):
    """A one-message call that waits until every send lane has one: each lane opens its connection."""

    def __init__(self, barrier: threading.Barrier, session_id: str | None = None) -> None:
        super().__init__([ServiceBusMessage(b"warm-up", session_id=session_id)])
        self._barrier = barrier

    def __iter__(self):  # the sender lists its messages once, in the lane's thread
        self._barrier.wait(30)
        return super().__iter__()


def partition_run(config: Any, n: int, failed_over: tuple[str, ...] = (), sessions: int = 0,
                  to: str | None = "") -> float:
    """Messages/s of one sink partition run over ``n`` rows (Arrow batches of 10,000 rows, as mapInArrow); with
    ``sessions``, row ``i`` in session ``i % sessions``, to ``config.sink.entity``. Every row must go ``to``
    ``"primary"`` or ``"backlog"`` (by default the backlog when ``failed_over``, else the primary; ``None``: not
    checked): a row measures the path it names."""
    tag = uuid.uuid4().hex[:8]
    entity = config.sink.entity
    batches = [pa.RecordBatch.from_pydict({"body": [BODY] * min(10_000, n - start),
                                           "message_id": [f"run-{tag}-{i}" for i in range(start, min(start + 10_000, n))],
                                           **({"session_id": [_session(i, sessions)
                                                              for i in range(start, min(start + 10_000, n))]}
                                              if sessions else {})})
               for start in range(0, n, 10_000)]
    run = sink_module.PartitionRun(config, config.fingerprint(), 1, 0, failed_over, reject=False)
    # every connection open before the clock starts (a worker keeps them from batch to batch): the calling
    # thread's and each send lane's
    warm_session = "warm-up" if sessions else None
    run.sender.send(entity, ServiceBusMessage(b"warm-up", session_id=warm_session))
    if sessions:  # a message of each session: every backlog queue they hash to is peeked once (its receiver open)
        run.sender.send(entity, [ServiceBusMessage(b"warm-up", session_id=_session(i, sessions))
                                 for i in range(sessions)])
    warm = threading.Barrier(config.sink.sends_in_flight)
    futures = [run.sender.submit(entity, _Warm(warm, warm_session)) for _ in range(config.sink.sends_in_flight)]
    for future in futures:
        future.result()
    if sessions:  # the warm-up asked the backlog: the timed run asks again, as a partition does
        run.sender.new_batch()
    started = time.perf_counter()
    out = list(run.run(iter(batches)))
    seconds = time.perf_counter() - started
    summary = out[-1].to_pylist()[0]
    if summary["sent"] != n:
        raise RuntimeError(f"the partition run sent {summary['sent']} of {n}")
    to = ("backlog" if failed_over else "primary") if to == "" else to
    went = {"primary": summary["primary"], "backlog": sum(count for _, count in summary["backlog"])}
    if to is not None and went[to] != n:
        raise RuntimeError(f"the partition run sent {went} of {n} rows: the row measures the path to the {to}")
    return n / seconds


def fail_back(entity: str = QUEUE) -> None:
    """Close the senders and fail ``entity`` back, as a ping that succeeded would: a pair's health is the
    process's (its board outlives a sender), and the next row must start healthy."""
    sink_module.close_senders()
    for board in all_boards().values():
        board.ping_result(entity, True)


def rounds(count: int, raw: Callable[[], float], ours: Callable[[], float]) -> tuple[float, float]:
    rates: dict[str, list[float]] = {"raw": [], "ours": []}
    for r in range(count):
        for name in (("raw", "ours") if r % 2 == 0 else ("ours", "raw")):
            rates[name].append(raw() if name == "raw" else ours())
    return statistics.median(rates["raw"]), statistics.median(rates["ours"])


def emulator(work: Path, name: str, primary_latency: float, secondary_latency: float) -> EmulatorProcess:
    entities = work / f"{name}.yaml"
    entities.write_text("queues:\n" + "".join(f"  - name: {q}\n    max_size_in_megabytes: 5120\n"
                                               for q in (QUEUE, "syphon-raw", "syphon-job"))
                        + f"  - name: {SESSION_QUEUE}\n    max_size_in_megabytes: 5120\n    requires_session: true\n")
    return EmulatorProcess.start(data_dir=work / name, entities=entities, namespaces=[
        NamespaceOptions("primary", latency=primary_latency), NamespaceOptions("secondary", latency=secondary_latency)])


def config_for(emu: EmulatorProcess, in_flight: int, connections: int = 1, *, prefix: str | None = None,
               **replication: Any) -> Any:
    """The bench's configuration; with ``prefix``, the sessions rows': ``SESSION_QUEUE``, four backlog queues
    named ``prefix``-N (their own, so no other row's parked messages are peeked)."""
    p, s = emu["primary"], emu["secondary"]
    sa: dict[str, Any] = {"backlog_queue_count": 1, "failover_interval": "0s", "ping_primary_interval": "30m"}
    if prefix is not None:
        sa.update(backlog_queue_count=4, backlog_prefix=prefix)
    return load_config({
        "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
        "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
        "send_availability": sa,
        "sink": {"entity": QUEUE if prefix is None else SESSION_QUEUE, "sends_in_flight": in_flight,
                 "connections_per_entity": connections},
        **({"replication": replication} if replication else {}),
    })


def failed_over_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float]:
    config = config_for(emu, args.in_flight)
    sender = sink_module.sender_for(config)
    sender.pair()
    [backlog] = sender.backlog_queues
    fault(emu["primary"].admin_url, "down")
    try:
        sender.board.assume_failed_over(QUEUE)
        return rounds(args.rounds, lambda: raw_sequential(emu["secondary"].connection_string, backlog, args.messages),
                      lambda: partition_run(config, args.messages, (QUEUE,)))
    finally:
        heal(emu["primary"].admin_url)
        fail_back()


def healthy_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float]:
    config = config_for(emu, args.in_flight)
    try:
        return rounds(args.rounds, lambda: raw_sequential(emu["primary"].connection_string, QUEUE, args.messages),
                      lambda: partition_run(config, args.messages))
    finally:
        sink_module.close_senders()


def _session_counters(sender: Any) -> str:
    stats = sender.stats()
    return ", ".join(f"{k} {stats.get(k, 0)}" for k in ("session_peeks", "session_follows", "session_peek_failures", "session_held",
                                                           "session_unordered"))


def healthy_sessions_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float]:
    """The healthy sink with sessions, nothing parked: one peek per backlog queue per partition."""
    config = config_for(emu, args.in_flight, prefix="latency-healthy")
    sender = sink_module.sender_for(config)
    sender.pair()  # the backlog queues exist (some failover once made them): each partition peeks them
    try:
        rates = rounds(args.rounds,
                       lambda: raw_sequential(emu["primary"].connection_string, SESSION_QUEUE, args.messages,
                                              args.sessions),
                       lambda: partition_run(config, args.messages, sessions=args.sessions))
        print(f"  (healthy with sessions: {_session_counters(sender)})", flush=True)
        return rates
    finally:
        sink_module.close_senders()


def failed_over_sessions_row(emu: EmulatorProcess, args: argparse.Namespace, prefix: str) -> tuple[float, float]:
    """The failed-over sink with sessions: each session's messages to the backlog queue its id hashes to."""
    config = config_for(emu, args.in_flight, prefix=prefix)
    sender = sink_module.sender_for(config)
    sender.pair()
    backlog = sender.backlog_queues[0]
    fault(emu["primary"].admin_url, "down")
    try:
        sender.board.assume_failed_over(SESSION_QUEUE)
        rates = rounds(args.rounds,
                       lambda: raw_sequential(emu["secondary"].connection_string, backlog, args.messages),
                       lambda: partition_run(config, args.messages, (SESSION_QUEUE,), sessions=args.sessions))
        print(f"  (failed over with sessions: {_session_counters(sender)})", flush=True)
        return rates
    finally:
        heal(emu["primary"].admin_url)
        fail_back(SESSION_QUEUE)


def park_others(conn_str: str, queues: list[str], n: int) -> None:
    """``n`` messages of another entity, without sessions, parked in each of ``queues`` as its failover would."""
    from spark_sb import messages as msgs

    with ServiceBusClient.from_connection_string(conn_str) as client:
        for queue in queues:
            with client.get_queue_sender(queue) as sender:
                for start in range(0, n, 200):  # 200 x 1 KiB fit a batch of 256 KB
                    batch = sender.create_message_batch()
                    for i in range(start, min(n, start + 200)):
                        batch.add_message(msgs.to_backlog(ServiceBusMessage(BODY, message_id=f"other-{i}"),
                                                          "other-entity"))
                    sender.send_messages(batch)


def first_session_send(config: Any, sessions: int, rounds: int) -> float:
    """Seconds a partition's first send takes, one message of each of ``sessions`` sessions, the backlog asked
    again (``new_batch``) as a partition does; median of ``rounds``, after the process's first question."""
    sender = sink_module.sender_for(config)
    entity = config.sink.entity

    def one() -> list[ServiceBusMessage]:
        return [ServiceBusMessage(b"first", session_id=_session(i, sessions)) for i in range(sessions)]

    sender.send(entity, one())  # the process's first question: a new worker reads the backlog queues once
    times = []
    for _ in range(rounds):
        sender.new_batch()
        started = time.perf_counter()
        sender.send(entity, one())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def others_parked_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[tuple[float, float], float, float]:
    """The healthy sink with sessions, nothing of them parked but ``--others-parked`` messages of another entity
    in each backlog queue; and a partition's first session send with and without them (seconds)."""
    clean = config_for(emu, args.in_flight, prefix="latency-clean")
    others = config_for(emu, args.in_flight, prefix="latency-others")
    try:
        sink_module.sender_for(clean).pair()
        sender = sink_module.sender_for(others)
        sender.pair()
        park_others(emu["secondary"].connection_string, list(sender.backlog_queues), args.others_parked)
        without = first_session_send(clean, args.sessions, max(5, args.rounds))
        with_others = first_session_send(others, args.sessions, max(5, args.rounds))
        rates = rounds(args.rounds,
                       lambda: raw_sequential(emu["primary"].connection_string, SESSION_QUEUE, args.messages,
                                              args.sessions),
                       lambda: partition_run(others, args.messages, sessions=args.sessions))
        print(f"  (healthy with sessions, {args.others_parked} others parked per queue: {_session_counters(sender)};"
              f" a partition's first session send {with_others:.3f} s, {without:.3f} s without them)", flush=True)
        return rates, with_others, without
    finally:
        sink_module.close_senders()


def _purge(conn_str: str, queues: list[str]) -> None:
    from azure.servicebus import ServiceBusReceiveMode

    with ServiceBusClient.from_connection_string(conn_str) as client:
        for queue in queues:
            with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
                while receiver.receive_messages(max_message_count=500, max_wait_time=1):
                    pass


def following_sessions_row(emu: EmulatorProcess, args: argparse.Namespace, prefix: str) -> tuple[float, float]:
    """The healthy sink whose sessions each have a message parked: every message follows into the backlog."""
    config = config_for(emu, args.in_flight, prefix=prefix)
    sender = sink_module.sender_for(config)
    sender.pair()
    queues = list(sender.backlog_queues)
    s = emu["secondary"]

    def parked_then_run() -> float:
        """Empty the backlog, park one message of every session (the entity failed over: with a failover
        interval of 0 one failure does it, and the next ping is half an hour away), fail back, then the timed
        run; checks that every message of the run followed its session into the backlog."""
        _purge(s.connection_string, queues)
        sender.board.record_failure(SESSION_QUEUE)
        tag = uuid.uuid4().hex[:8]
        parked = sender.send(SESSION_QUEUE, [ServiceBusMessage(b"parked", message_id=f"parked-{tag}-{k}",
                                                               session_id=_session(k, args.sessions))
                                             for k in range(args.sessions)])
        if parked.backlog != args.sessions:
            raise RuntimeError(f"parked {parked.backlog} of {args.sessions} sessions' messages")
        sender.board.record_success(SESSION_QUEUE)  # failed back: the primary takes sessions with nothing parked
        before = sender.stats()["session_follows"]
        rate = partition_run(config, args.messages, sessions=args.sessions, to="backlog")
        if sender.stats()["session_follows"] - before != args.messages:
            raise RuntimeError(f"{sender.stats()['session_follows'] - before} of {args.messages} messages followed")
        return rate

    try:
        rates = rounds(args.rounds, lambda: raw_sequential(s.connection_string, queues[0], args.messages),
                       parked_then_run)
        print(f"  (following with sessions: {_session_counters(sender)})", flush=True)
        return rates
    finally:
        sink_module.close_senders()


def shared_connection_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float]:
    """(a connection per send in flight, one connection per entity): the healthy sink on loopback, the sends in
    flight each on its own connection (``connections_per_entity`` = ``sends_in_flight``, the sink before issue
    36) against all of them sharing one."""
    shared = config_for(emu, args.in_flight)
    each = config_for(emu, args.in_flight, connections=args.in_flight)
    try:
        return rounds(args.rounds, lambda: partition_run(each, args.messages),
                      lambda: partition_run(shared, args.messages))
    finally:
        sink_module.close_senders()


def link_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float]:
    """(a connection per send in flight, one connection): ``--in-flight`` threads sending pre-built batches of 1 KiB
    messages to the secondary through :meth:`spark_sb.bus.Namespace.send`, each on its own connection against all
    on one link (``spark_sb.bus.pipeline``). No rows, no encoding in the timing: what the link itself costs."""
    from concurrent.futures import ThreadPoolExecutor

    from spark_sb import bus

    config = config_for(emu, args.in_flight)

    def run(connections: int) -> float:
        namespace = bus.Namespace("secondary", config.secondary, connections_per_entity=connections)
        pool = ThreadPoolExecutor(args.in_flight)
        try:
            lanes = list(range(args.in_flight))

            def lane_batches(lane: int) -> list[Any]:
                bus.send_lane(lane)
                namespace.send(QUEUE, _one_batch(namespace, [b"warm-up"]))  # its connection open before the clock
                out, left = [], args.messages // args.in_flight
                while left > 0:
                    with namespace.batch_sender(QUEUE) as sdk_sender:
                        batch = sdk_sender.create_message_batch()
                    while left > 0:
                        try:
                            batch.add_message(ServiceBusMessage(BODY))
                        except ValueError:
                            break
                        left -= 1
                    out.append(batch)
                return out

            prepared = list(pool.map(lane_batches, lanes))

            def send_all(lane: int) -> None:
                bus.send_lane(lane)
                for batch in prepared[lane]:
                    namespace.send(QUEUE, batch)

            started = time.perf_counter()
            list(pool.map(send_all, lanes))
            return sum(len(b) for batches in prepared for b in batches) / (time.perf_counter() - started)
        finally:
            pool.shutdown()
            namespace.close()

    return rounds(args.rounds, lambda: run(args.in_flight), lambda: run(1))


def _one_batch(namespace: Any, bodies: list[bytes]) -> Any:
    with namespace.batch_sender(QUEUE) as sdk_sender:
        batch = sdk_sender.create_message_batch()
    for body in bodies:
        batch.add_message(ServiceBusMessage(body))
    return batch


def emulator_cpu(emu: EmulatorProcess) -> float:
    """CPU seconds the emulator's process has used (user + system, from /proc)."""
    fields = Path(f"/proc/{emu.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def active_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(raw, active, paired) rates: active replication and the paired sink on the same emulator; and the share of
    a core the emulator's process used during the active runs (it stores two copies, one through its relay)."""
    active = config_for(emu, args.in_flight, mode="active")
    paired = config_for(emu, args.in_flight)
    busy: list[float] = []

    def active_run() -> float:
        cpu, started = emulator_cpu(emu), time.perf_counter()
        rate = partition_run(active, args.messages)
        busy.append((emulator_cpu(emu) - cpu) / (time.perf_counter() - started))
        return rate

    try:
        raw, act = rounds(args.rounds, lambda: raw_sequential(emu["primary"].connection_string, QUEUE, args.messages),
                          active_run)
        sink_module.close_senders()
        pair = statistics.median(partition_run(paired, args.messages) for _ in range(args.rounds))
        return raw, act, pair, statistics.median(busy)
    finally:
        sink_module.close_senders()


def syphon_row(emu: EmulatorProcess, args: argparse.Namespace, work: Path) -> tuple[float, float]:
    """(raw loop, syphon job) rates moving ``--syphon-messages`` parked evenly over ten backlog queues (the
    product's default ``backlog_queue_count``, over which the rotation spreads a failed-over sink's chunks;
    bench/syphon.py: the raw loop receives, sends and completes one page after the other; the job is timed from
    its first batch's end and reads up to ``syphon.receives_in_flight``, 8, queues at once)."""
    import importlib.util

    # bench/syphon.py under another name: its spark_job imports jobs/syphon.py as "syphon"
    spec = importlib.util.spec_from_file_location("syphon_bench", Path(__file__).resolve().parent / "syphon.py")
    assert spec is not None and spec.loader is not None
    syphon_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(syphon_bench)

    p, s = emu["primary"], emu["secondary"]
    config = {
        "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
        "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
        "send_availability": {"backlog_queue_count": 10, "backlog_prefix": "latency-syphon"},
        "syphon": {"receive_batch": 100, "retry_interval": "1s", "checkpoint_location": str(work / "checkpoint"),
                   "ledger": str(work / "ledger")},
    }
    sender = sink_module.sender_for(load_config(config))
    sender.pair()
    queues = list(sender.backlog_queues)
    sink_module.close_senders()
    n = args.syphon_messages
    syphon_bench.park_evenly(s.connection_string, queues, "syphon-raw", n, "raw")
    raw = syphon_bench.raw_loop(s.connection_string, p.connection_string, queues, "syphon-raw", n, 100)
    syphon_bench.park_evenly(s.connection_string, queues, "syphon-job", n, "job")
    job, _ = syphon_bench.spark_job(config, n, max(100, n // 3))
    return raw, job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=12000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=8, help="sink.sends_in_flight (default: %(default)s)")
    parser.add_argument("--syphon-messages", type=int, default=1200,
                        help="messages the syphon rows move (default: %(default)s; the raw loop completes one "
                             "message per round trip)")
    parser.add_argument("--no-spark", action="store_true", help="skip the syphon job row (the only one on Spark)")
    parser.add_argument("--sessions", type=int, default=12,
                        help="sessions in the sessions rows (default: %(default)s; 0: no sessions rows)")
    parser.add_argument("--others-parked", type=int, default=0,
                        help="with sessions: also the healthy sessions row with this many messages of another entity "
                             "parked in each backlog queue (issue 48: 5000), and a partition's first session send "
                             "with and without them")
    parser.add_argument("--quick", action="store_true",
                        help="the far-namespace and loopback rows only, in under two minutes (4000 messages, "
                             "3 rounds, no Spark, no sessions rows): what a change to the send path reports")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.rounds, args.no_spark, args.sessions = min(args.messages, 4000), 3, True, 0
    work = Path(tempfile.mkdtemp(prefix="sb-bench-latency-"))
    rows: list[tuple[str, float, float, str]] = []

    def emit(what: str, raw: float, ours: float, goal: str) -> None:
        rows.append((what, raw, ours, goal))
        print(f"{what}: raw {raw:,.0f} msg/s, spark-sb {ours:,.0f} msg/s, ratio {ours / raw:.2f} ({goal})",
              flush=True)

    def beside(what: str, rates: tuple[float, float], without: tuple[float, float], goal: str) -> None:
        """A sessions row, its goal column giving its rate over the row without sessions."""
        emit(what, *rates, f"{rates[1] / without[1]:.2f} of {goal}")

    def session_rows(emu: EmulatorProcess, plain: tuple[float, float], where: str) -> None:
        """The failed-over and following sessions rows beside ``plain`` (failed over without sessions)."""
        if not args.sessions:
            return
        beside(f"sink failed over with {args.sessions} sessions (4 backlog queues), {where}",
               failed_over_sessions_row(emu, args, "latency-failed"), plain, "the row without sessions")
        beside(f"sink following: primary healthy, {args.sessions} sessions parked, {where}",
               following_sessions_row(emu, args, "latency-follow"), plain, "failed over without sessions")

    emu = emulator(work, "near", 0.0, 0.0)
    try:
        plain = failed_over_row(emu, args)
        emit("sink failed over, secondary on loopback", *plain, ">= 1.0")
        session_rows(emu, plain, "secondary on loopback")
        emit("sink healthy, loopback", *healthy_row(emu, args), ">= 1.2")
        emit("sink healthy, loopback: one connection per entity (raw: a connection per send in flight)",
             *shared_connection_row(emu, args), ">= 1.0")
    finally:
        emu.stop()
    emu = emulator(work, "far-secondary", 0.0, 0.020)
    try:
        plain = failed_over_row(emu, args)
        emit("sink failed over, secondary 40 ms away", *plain, ">= 2.5")
        emit(f"{args.in_flight} sends in flight of pre-built batches, secondary 40 ms away: one link (raw column: "
             "a connection per send in flight)", *link_row(emu, args), ">= 0.9")
        session_rows(emu, plain, "secondary 40 ms away")
        raw, act, pair, busy = active_row(emu, args)
        emit("active replication, secondary 40 ms away", raw, act,
             f"{act / pair:.2f} of paired; goal >= 0.95; the emulator's process {busy:.0%} of a core")
        if not args.no_spark:
            emit("syphon job, secondary 40 ms away (raw: receive, send, complete)", *syphon_row(emu, args, work),
                 ">= 1.5")
    finally:
        emu.stop()
    emu = emulator(work, "near-primary", 0.0025, 0.0)
    try:
        plain = healthy_row(emu, args)
        emit("sink healthy, primary 5 ms away", *plain, ">= 1.6")
        if args.sessions:
            beside(f"sink healthy with {args.sessions} sessions, nothing parked (4 backlog queues peeked), primary "
                   "5 ms away", healthy_sessions_row(emu, args), plain, "the row without sessions")
        if args.sessions and args.others_parked:
            rates, with_others, without = others_parked_row(emu, args)
            beside(f"sink healthy with {args.sessions} sessions, {args.others_parked:,} messages of another entity "
                   "parked in each backlog queue, primary 5 ms away", rates, plain,
                   f"the row without sessions; a partition's first session send +{with_others - without:.3f} s "
                   "(goal < 0.2 s)")
    finally:
        emu.stop()

    print(f"\n{args.messages} x 1 KiB messages in chunks of {CHUNK}, sink.sends_in_flight {args.in_flight}, "
          f"median of {args.rounds} rounds; raw = the SDK sending sequentially on the same emulator\n")
    print("| path | raw SDK, sequential | spark-sb | ratio | goal |")
    print("| --- | ---: | ---: | ---: | --- |")
    for what, raw, ours, goal in rows:
        print(f"| {what} | {raw:,.0f} msg/s | {ours:,.0f} msg/s | {ours / raw:.2f} | {goal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
