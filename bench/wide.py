"""Many Python workers against one namespace's limits (issue 36, "When Service Bus pushes back"): what a wide Spark
job does to Service Bus, without Spark.

A Spark job runs one Python worker (a process) per concurrent task, each with the sink's paired sender of its own.
Here ``--workers`` processes (multiprocessing, spawn) each run one sink partition run (``PartitionRun``, what each
executor runs inside ``mapInArrow``, as bench/latency.py times it) of ``--messages-per-worker`` rows of 100-byte
bodies, all at once, to one queue of an emulator (``EmulatorProcess``) whose primary namespace admits
``--ops-per-second`` operations a second (``NamespaceOptions(ops_per_second=...)``: over it a send is answered
ServerBusy, "Please wait N seconds") and at most 5,000 connections. The parent samples the emulator's stats
(``GET {admin_url}/$emulator/stats``) every ``--sample-every`` seconds for the connections each namespace holds.

Phases:

* **throttled**: every worker sends to the healthy primary's queue, its connections opened before the clock
  starts (``send_availability.failover_interval`` 30 s: throttling would have time to cause failovers if it were
  wrongly counted as an outage);
* **failed over** (``--failover``): the primary's queue faulted ``down`` before the workers start; each worker
  retries it for ``--failover-interval``, fails over and sends to its backlog queue on the secondary (one queue
  per entity at a time: the rotation keeps the one it picked).

Afterwards the parent drains the queues (receive-and-delete) and compares the message ids with those sent: lost =
acknowledged (a partition run that ended well) and not received, duplicated = received more than once; the
messages of a run that failed (Spark would run its task again) and not received are counted apart. Prints a
Markdown table: the peak connections held per namespace against the formula (workers x ``connections_per_entity``
x entities, on the namespace sent to), the throughput (messages admitted a second, from the workers' timings, from
the emulator's ``ops`` counter, and once throttled) against the throttle, the throttled answers, the senders'
``busy_waits``, ``connection_refusals`` and ``failovers`` (``PairedSender.stats``), the outage-class failures (the
sender's "is failing" log records), the partition runs that failed, lost and duplicated. Expected under
throttling alone: no failover, nothing lost or duplicated, a throughput of at least 0.9 of ``--ops-per-second``.

    .venv/bin/python bench/wide.py [--workers 24] [--messages-per-worker 2000] [--ops-per-second 3000]
                                   [--sends-in-flight 8] [--connections-per-entity 1] [--failover]
                                   [--failover-interval 2s] [--timeout 300]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode
from latency import QUEUE, _Warm

from spark_sb import sink as sink_module
from spark_sb.config import load_config
from spark_sb.emulator import EmulatorProcess, NamespaceOptions, fault, heal
from spark_sb.emulator.server import send_control

BODY = b"x" * 100
NAMESPACES = ("primary", "secondary")


def config_for(info: dict[str, dict[str, str]], phase: dict[str, Any]) -> Any:
    """A worker's configuration: bench/latency.py's, with the phase's failover interval and sink settings."""
    return load_config({
        "primary": {"connection_string": info["primary"]["connection_string"],
                    "admin_endpoint": info["primary"]["admin_url"]},
        "secondary": {"connection_string": info["secondary"]["connection_string"],
                      "admin_endpoint": info["secondary"]["admin_url"]},
        "send_availability": {"backlog_queue_count": 1, "failover_interval": phase["failover_interval"],
                              "ping_primary_interval": "30m"},
        "sink": {"entity": QUEUE, "sends_in_flight": phase["sends_in_flight"],
                 "connections_per_entity": phase["connections_per_entity"]},
    })


def message_ids(phase: str, worker: int, n: int) -> list[str]:
    return [f"{phase}-{worker}-{i}" for i in range(n)]


# --- the worker process -----------------------------------------------------------------------------------------

def _warm_up(sender: Any, in_flight: int) -> None:
    """Open every connection before the clock starts (bench/latency.py's partition_run): the calling thread's and
    each send lane's."""
    sender.send(QUEUE, ServiceBusMessage(b"warm-up", message_id="warm-up"))
    barrier = threading.Barrier(in_flight)
    for future in [sender.submit(QUEUE, _Warm(barrier)) for _ in range(in_flight)]:
        future.result(timeout=60)


#: what the sender logs (spark_sb's log records, by their message template) that the table counts
EVENTS = {"failing": "is failing; failover in", "connection_lost": "connection lost (",
          "backlog_failed": "backlog queue %r failed"}


class _Events(logging.Handler):
    """Counts the sender's log records of :data:`EVENTS` (an outage-class failure that starts a failover interval,
    both namespaces' clients closed for a lost connection, a backlog send that failed)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        for name, template in EVENTS.items():
            if template in str(record.msg):
                self.counts[name] += 1


def _run(index: int, info: dict[str, dict[str, str]], phase: dict[str, Any],
         commands: multiprocessing.connection.Connection, results: Any, events: _Events) -> None:
    config = config_for(info, phase)
    sender = sink_module.sender_for(config)
    if phase["warm_up"]:
        _warm_up(sender, phase["sends_in_flight"])
    ids = message_ids(phase["name"], index, phase["messages"])
    batches = [pa.RecordBatch.from_pydict({"body": [BODY] * len(ids[start:start + 10_000]),
                                           "message_id": ids[start:start + 10_000]})
               for start in range(0, len(ids), 10_000)]
    before = sender.stats()
    events.counts.clear()
    results.put(("ready", index, None))
    if not commands.poll(phase["timeout"]) or commands.recv() != "go":
        raise RuntimeError("no go from the parent")
    run = sink_module.PartitionRun(config, config.fingerprint(), phase["name"], index, (), reject=False)
    started = time.monotonic()
    error = None
    sent = primary = 0
    try:
        summary = list(run.run(iter(batches)))[-1].to_pydict()
        sent, primary = summary["sent"][0], summary["primary"][0]
    except Exception as exc:  # what the partition's task would fail with: reported, the others go on
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    ended = time.monotonic()
    after = sender.stats()
    results.put(("done", index, {"started": started, "ended": ended, "sent": sent, "primary": primary,
                                 "error": error, "events": dict(events.counts),
                                 "stats": {k: after.get(k, 0) - before.get(k, 0) for k in after}}))


def worker(index: int, info: dict[str, dict[str, str]], commands: multiprocessing.connection.Connection,
           results: Any, log: str) -> None:
    """One Python worker: runs the phases the parent sends (a dict each; None: exit), one partition run each.
    spark_sb's INFO log goes to ``log``, its warnings to stderr too."""
    events = _Events()
    to_file = logging.FileHandler(log)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
    to_stderr = logging.StreamHandler()
    to_stderr.setLevel(logging.WARNING)
    to_stderr.setFormatter(logging.Formatter(f"worker {index}: %(message)s"))
    spark_sb_log = logging.getLogger("spark_sb")
    spark_sb_log.setLevel(logging.INFO)
    for handler in (events, to_file, to_stderr):
        spark_sb_log.addHandler(handler)
    try:
        while commands.poll(900):
            phase = commands.recv()
            if phase is None:
                break
            try:
                _run(index, info, phase, commands, results, events)
            except BaseException:
                results.put(("error", index, traceback.format_exc(limit=8)))
    finally:
        sink_module.close_senders()


# --- the parent -------------------------------------------------------------------------------------------------

class Sampler(threading.Thread):
    """The emulator's stats of every namespace every ``every`` seconds: the peak connections each held."""

    def __init__(self, emu: EmulatorProcess, every: float) -> None:
        super().__init__(name="wide-sampler", daemon=True)
        self.emu = emu
        self.every = every
        self.stop = threading.Event()
        self.peak = dict.fromkeys(NAMESPACES, 0)
        #: the primary's (monotonic time, ops, throttled) at each sample
        self.primary: list[tuple[float, int, int]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            for name in NAMESPACES:
                try:
                    sample = send_control(self.emu[name].admin_url, "stats", timeout=5)
                except (OSError, RuntimeError):
                    continue
                self.peak[name] = max(self.peak[name], sample["connections"])
                if name == "primary":
                    self.primary.append((time.monotonic(), sample["ops"], sample["throttled"]))
            self.stop.wait(self.every)

    def finish(self) -> dict[str, int]:
        self.stop.set()
        self.join(10)
        return self.peak


def stats(emu: EmulatorProcess) -> dict[str, dict[str, Any]]:
    return {name: send_control(emu[name].admin_url, "stats", timeout=10) for name in NAMESPACES}


def collect(results: Any, kind: str, count: int, deadline: float) -> dict[int, Any]:
    """``count`` answers of ``kind`` from the workers by ``deadline`` (monotonic); a worker's error is raised."""
    got: dict[int, Any] = {}
    while len(got) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(got)} of {count} workers answered {kind!r} in time")
        try:
            what, index, payload = results.get(timeout=min(left, 5))
        except Exception:  # queue.Empty
            continue
        if what == "error":
            raise RuntimeError(f"worker {index} failed:\n{payload}")
        if what == kind:
            got[index] = payload
    return got


def drain(conn_str: str, queue: str, expected: int, seconds: float) -> Counter[str]:
    """Message ids received from ``queue`` (receive-and-delete) until it stays empty for 3 s after ``expected``
    arrived (10 s before), or ``seconds`` passed."""
    ids: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    with ServiceBusClient.from_connection_string(conn_str) as client, client.get_queue_receiver(
            queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE, prefetch_count=0) as receiver:
        while time.monotonic() < deadline:
            wait = 3 if sum(ids.values()) >= expected else 10
            page = receiver.receive_messages(max_message_count=1000, max_wait_time=wait)
            if not page:
                break
            ids.update(str(m.message_id) for m in page)
    return ids


def phase(emu: EmulatorProcess, commands: list[multiprocessing.connection.Connection], results: Any,
          args: argparse.Namespace, name: str, failover: bool) -> dict[str, Any]:
    workers = len(commands)
    settings = {"name": name, "messages": args.messages_per_worker, "sends_in_flight": args.sends_in_flight,
                "connections_per_entity": args.connections_per_entity, "timeout": args.timeout,
                "failover_interval": args.failover_interval if failover else "30s", "warm_up": not failover}
    deadline = time.monotonic() + args.timeout
    if failover:
        fault(emu["primary"].admin_url, "down", entity=QUEUE)
    try:
        for conn in commands:
            conn.send(settings)
        collect(results, "ready", workers, deadline)
        before = stats(emu)
        sampler = Sampler(emu, args.sample_every)
        sampler.start()
        for conn in commands:
            conn.send("go")
        try:
            done = collect(results, "done", workers, deadline)
        finally:
            peak = sampler.finish()
        after = stats(emu)
    finally:
        if failover:
            heal(emu["primary"].admin_url, entity=QUEUE)
    started = min(d["started"] for d in done.values())
    seconds = max(d["ended"] for d in done.values()) - started
    sent = sum(d["sent"] for d in done.values())
    totals: Counter[str] = Counter()
    events: Counter[str] = Counter()
    for d in done.values():
        totals.update(d["stats"])
        events.update(d["events"])
    errors = Counter(d["error"] for d in done.values() if d["error"])

    # lost and duplicated: every queue the phase may have sent to, drained by message id
    wanted = {i for w in range(workers) for i in message_ids(name, w, args.messages_per_worker)}
    acknowledged = {i for w, d in done.items() if not d["error"]
                    for i in message_ids(name, w, args.messages_per_worker)}
    received: Counter[str] = Counter()
    config = load_config({"primary": {"connection_string": emu["primary"].connection_string},
                          "secondary": {"connection_string": emu["secondary"].connection_string},
                          "send_availability": {"backlog_queue_count": 1}})
    sent_primary = sum(d["primary"] for d in done.values())
    drain_seconds = 60 + 2 * len(wanted) / args.ops_per_second
    received.update(drain(emu["primary"].connection_string, QUEUE, sent_primary, drain_seconds))
    if failover:
        for backlog in config.send_availability.backlog_queue_names():
            received.update(drain(emu["secondary"].connection_string, backlog, sent - sent_primary, drain_seconds))
    ours = Counter({i: n for i, n in received.items() if i in wanted})
    to = "secondary" if failover else "primary"
    ended = started + seconds
    ops = after["primary"]["ops"] - before["primary"]["ops"]
    # once throttled: the primary's ops from the first sample that saw a throttled answer to the last worker's end
    # (the token bucket starts full: the first second's worth goes through at once)
    first = next(((t, o) for t, o, throttled in sampler.primary
                  if throttled > before["primary"]["throttled"] and t < ended), None)
    throttled_rate = None if first is None or ended - first[0] < 1 else \
        (after["primary"]["ops"] - first[1]) / (ended - first[0])
    return {
        "phase": name, "workers": workers, "to": to, "peak": peak, "formula": workers * args.connections_per_entity,
        "refused": {n: after[n]["connections_refused"] - before[n]["connections_refused"] for n in NAMESPACES},
        "rate": sent / seconds, "ops_rate": ops / seconds, "throttled_rate": throttled_rate, "seconds": seconds,
        "sent": sent, "held_after": {n: after[n]["connections"] for n in NAMESPACES},
        "throttled": after["primary"]["throttled"] - before["primary"]["throttled"],
        "busy_waits": totals["busy_waits"], "refusals": totals["connection_refusals"],
        "failovers": totals["failovers"], "events": events, "errors": errors,
        # lost: acknowledged (a partition run that ended well) and not received; a failed run's messages were not
        # acknowledged (Spark would run its task again): counted apart
        "lost": len(acknowledged - set(ours)), "unacknowledged": len(wanted - acknowledged - set(ours)),
        "duplicated": sum(1 for n in ours.values() if n > 1),
        "samples": len(sampler.primary),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=24, help="Python worker processes (default: %(default)s)")
    parser.add_argument("--messages-per-worker", type=int, default=2000, help="(default: %(default)s)")
    parser.add_argument("--ops-per-second", type=float, default=3000,
                        help="the primary's throttle, operations a second (default: %(default)s)")
    parser.add_argument("--sends-in-flight", type=int, default=8, help="sink.sends_in_flight (default: %(default)s)")
    parser.add_argument("--connections-per-entity", type=int, default=1,
                        help="sink.connections_per_entity (default: %(default)s)")
    parser.add_argument("--failover", action="store_true", help="also run the failed-over phase")
    parser.add_argument("--failover-interval", default="2s",
                        help="send_availability.failover_interval of the failed-over phase (default: %(default)s)")
    parser.add_argument("--sample-every", type=float, default=0.1,
                        help="seconds between two samples of the emulator's stats (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a phase may take, workers' start included (default: %(default)s)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sb-bench-wide-"))
    entities = work / "entities.yaml"
    entities.write_text(f"queues:\n  - name: {QUEUE}\n    max_size_in_megabytes: 5120\n")
    emu = EmulatorProcess.start(data_dir=None, entities=entities, namespaces=[
        NamespaceOptions("primary", ops_per_second=args.ops_per_second), NamespaceOptions("secondary")])
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    info = {n: {"connection_string": emu[n].connection_string, "admin_url": emu[n].admin_url} for n in NAMESPACES}
    commands: list[multiprocessing.connection.Connection] = []
    procs: list[Any] = []
    rows: list[dict[str, Any]] = []
    try:
        for index in range(args.workers):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(index, info, theirs, results, str(work / f"worker-{index}.log")),
                               daemon=True,
                               name=f"wide-worker-{index}")
            proc.start()
            commands.append(ours)
            procs.append(proc)
        for name, failover in (("throttled", False), ("failed-over", True)):
            if failover and not args.failover:
                continue
            row = phase(emu, commands, results, args, name, failover)
            rows.append(row)
            print(f"{name}: {row['sent']:,} messages in {row['seconds']:.1f} s, peak connections {row['peak']}, "
                  f"held at the end {row['held_after']}, refused {row['refused']}, {row['samples']} samples; "
                  f"sender events {dict(row['events'])}", flush=True)
            for error, count in row["errors"].items():
                print(f"  {count} of {args.workers} workers failed: {error}", flush=True)
    finally:
        for conn in commands:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
        emu.stop()

    limit = args.ops_per_second
    print(f"\nworkers' logs: {work}")
    print(f"\n{args.workers} workers x {args.messages_per_worker:,} messages of {len(BODY)} bytes to one queue, "
          f"chunks of 500; primary throttled at {limit:,.0f} ops/s, 5,000 connections\n")
    print("| phase | workers | sends_in_flight | connections_per_entity | peak connections held (primary / "
          "secondary) | formula | msg/s (workers) | msg/s (emulator ops) | once throttled (ops) | ratio to the "
          "throttle | throttled answers | busy_waits | connection_refusals | outage-class failures | failovers | "
          "workers failed | not received: of failed runs | lost | duplicated |")
    print("| --- |" + " ---: |" * 19)
    for r in rows:
        primary = r["to"] == "primary"
        once = r["throttled_rate"]
        ratio = ("n/a (not throttled)" if not primary else f"{r['rate'] / limit:.2f}" if once is None
                 else f"{once / limit:.2f} (once throttled)")
        ops = f"{r['ops_rate']:,.0f}" if primary else "n/a"
        once_text = f"{once:,.0f}" if primary and once is not None else "n/a"
        print(f"| {r['phase']} | {r['workers']} | {args.sends_in_flight} | {args.connections_per_entity} | "
              f"{r['peak']['primary']} / {r['peak']['secondary']} | {r['formula']} on the {r['to']} | "
              f"{r['rate']:,.0f} | {ops} | {once_text} | {ratio} | {r['throttled']:,} | {r['busy_waits']:,} | "
              f"{r['refusals']} | "
              f"{r['events']['failing']} | {r['failovers']} | {sum(r['errors'].values())} | "
              f"{r['unacknowledged']:,} | {r['lost']:,} | "
              f"{r['duplicated']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
