"""The fault matrix (issue 9): one streaming run through the paired sink and then the syphon job per fault,
and one table that accounts for every row.

    flock /tmp/spark.lock .venv/bin/python bench/chaos.py [--rows 320] [--batches 8] [--only NAME ...] [--keep]

Each row of the table is a fresh emulator pair (a child process, free loopback ports, its own data dir) with two
primary queues, ``chaos-dedup`` (duplicate detection, a one-hour window) and ``chaos-plain`` (none). The input
is an exact, known set: parquet files written up front, two per batch (``maxFilesPerTrigger``), every key
``k00001``... once for each queue (the ``entity`` column), the key column giving each row's message id. The
writer (``jobs/paired_writer.py``'s ``start``, or the script itself in its own process) streams them through
``foreachBatch(PairedSink)`` while the fault happens; a supervisor restarts a query that failed from its
checkpoint (up to a few attempts), as a job scheduler would. Then the syphon job (``jobs/syphon.py``) moves the
backlog home, and the queues are counted per queue:

* produced: keys in the input; primary: messages received (peeked) in the primary queue;
* backlog / dead-lettered: left in the backlog queues / in the dead-letter queues (backlog and primary);
* rejected: distinct message ids in ``sink.reject_table`` (poison rows);
* lost: produced keys, less the rejected ones, not in the primary queue;
* duplicated: messages in the primary queue minus distinct keys there.

A step that does not finish in time is stopped and its row reported ``wedged`` with what was left. Prints
progress lines, then the table as Markdown (``on / off`` = duplicate detection on / off), and a verdict.
Exit code: 1 when anything was lost, 2 when nothing was lost but a row duplicated with duplicate detection
on, wedged or crashed, else 0. Spark runs in this process (``local[2,4]``: a failed task is retried) except
where a row runs the writer or the syphon in its own process to SIGKILL it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from azure.servicebus import ServiceBusClient, ServiceBusSubQueue

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired_send import _free_ports  # noqa: E402

from spark_sb import messages  # noqa: E402
from spark_sb.admin import admin_client  # noqa: E402
from spark_sb.emulator import EmulatorProcess, fault, heal  # noqa: E402
from spark_sb.paired import PairedSender  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
DEDUP, PLAIN = "chaos-dedup", "chaos-plain"
QUEUES = (DEDUP, PLAIN)
ENTITIES = f"""
queues:
  - name: {DEDUP}
    requires_duplicate_detection: true
    duplicate_detection_history_time_window: 1h
  - name: {PLAIN}
"""
MASTER = "local[2,4]"  # two cores, a failed task tried up to 4 times
FILES_PER_BATCH = 2
TRIGGER = "0.5s"
WRITER_TIMEOUT = 150.0  # seconds for the whole stream of a row, restarts included
SYPHON_TIMEOUT = 150.0
ROW_BUDGET = 420.0  # a row's thread is abandoned (wedged) after this
SUBPROCESS_ENV = {"PYSPARK_PYTHON": sys.executable, "SPARK_MASTER": MASTER, "SPARK_LOCAL_IP": "127.0.0.1",
                  # the file source needs its schema inferred: the writer job reads sink.source as is
                  "PYSPARK_SUBMIT_ARGS": "--conf spark.sql.streaming.schemaInference=true "
                                         "--conf spark.sql.streaming.stopTimeout=30s pyspark-shell"}

_STARTED = time.monotonic()


def say(text: str = "") -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f}s] {text}" if text else "", flush=True)


def _job(name: str) -> Any:
    """A jobs/ script as a module (by path: bench/syphon.py would shadow jobs/syphon.py by name)."""
    if str(JOBS) not in sys.path:
        sys.path.append(str(JOBS))  # jobs/syphon.py imports paired_writer
    spec = importlib.util.spec_from_file_location(f"chaos_job_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- results ---------------------------------------------------------------------------------------------


@dataclass
class Counts:
    """One primary queue's accounting at the end of a row."""

    produced: int = 0
    primary: int = 0
    backlog: int = 0
    dead: int = 0
    rejected: int = 0
    lost: int = 0
    duplicated: int = 0


@dataclass
class RowResult:
    name: str
    title: str
    status: str = "ok"  # ok, wedged, crashed
    counts: dict[str, Counts] = field(default_factory=lambda: {q: Counts() for q in QUEUES})
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def flag(self, status: str, note: str) -> None:
        if self.status == "ok" or status == "crashed":
            self.status = status
        self.notes.append(note)

    @property
    def lost(self) -> int:
        return sum(c.lost for c in self.counts.values())


# --- one row's world: an emulator pair, the input files, the configuration ------------------------------


class Stage:
    """Everything one row needs: a fresh emulator pair and backlog prefix, the input files, the writer and
    syphon runs (in this process or in their own), and the final count."""

    def __init__(self, bench: Bench, name: str, work: Path, result: RowResult) -> None:
        self.bench = bench
        self.name = name
        self.work = work
        self.result = result
        work.mkdir(parents=True)
        (work / "entities.yaml").write_text(ENTITIES)
        self.emu = EmulatorProcess.start(data_dir=work / "emulator", namespaces=_free_ports(),
                                         entities=work / "entities.yaml", log_file=work / "emulator.log")
        self.checkpoint = work / "checkpoint"
        self.source = work / "source"
        self.keys: list[str] = []
        self.poison: set[str] = set()  # rows that must be rejected
        self.edge: set[str] = set()  # rows that may be rejected or delivered, never lost
        self.finished: set[int] = set()  # batch ids whose sink call returned (in this process)
        self.batches = bench.batches
        self.config = self._config()
        with PairedSender.from_config(self.config) as sender:
            sender.pair()  # the backlog queues exist before anything streams (the syphon reads them all)
            self.backlog_queues = tuple(sender.backlog_queues)

    def _config(self) -> dict:
        p, s = self.emu["primary"], self.emu["secondary"]
        return {
            "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
            "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
            "send_availability": {"backlog_queue_count": 2, "failover_interval": "1s", "ping_primary_interval": "1s",
                                  "backlog_prefix": f"chaos-{self.name}", "backlog_cooldown": "2s",
                                  "primary_try_timeout": "2s"},
            "sink": {"entity": DEDUP, "key_column": "key", "chunk_size": 100, "trigger": TRIGGER,
                     "checkpoint_location": str(self.checkpoint),
                     "source": {"format": "parquet", "path": str(self.source),
                                "options": {"maxFilesPerTrigger": str(FILES_PER_BATCH)}}},
            "syphon": {"retry_interval": "1s", "receive_batch": 100,
                       "checkpoint_location": str(self.work / "syphon-checkpoint"),
                       "ledger": str(self.work / "ledger")},
        }

    @property
    def primary_admin(self) -> str:
        return self.emu["primary"].admin_url

    @property
    def secondary_admin(self) -> str:
        return self.emu["secondary"].admin_url

    def note(self, text: str) -> None:
        self.result.notes.append(text)
        say(f"  {self.name}: {text}")

    # the input

    def write_source(self, rows: int | None = None, big: dict[int, int] | None = None,
                     poison_batches: range | None = None) -> None:
        """``rows`` keys over the batches (``big``: {batch: extra keys}), each key once per primary queue,
        ``FILES_PER_BATCH`` parquet files per batch. ``poison_batches``: three rows the SDK cannot encode or
        that have no body in each of those batches (with ``application_properties`` and ``time_to_live``
        columns in every file)."""
        rows = rows or self.bench.rows
        self.source.mkdir()
        per_batch = [rows // self.batches + (1 if b < rows % self.batches else 0) for b in range(self.batches)]
        for b, extra in (big or {}).items():
            per_batch[b] += extra
        fields = [pa.field("key", pa.string()), pa.field("body", pa.string()), pa.field("entity", pa.string())]
        if poison_batches is not None:
            fields += [pa.field("application_properties", pa.map_(pa.string(), pa.int64())),
                       pa.field("time_to_live", pa.int64())]
        schema = pa.schema(fields)
        n = 0
        for b, count in enumerate(per_batch):
            batch_rows: list[dict] = []
            for _ in range(count):
                n += 1
                key = f"k{n:05d}"
                self.keys.append(key)
                row = {"key": key, "body": f"row {key}"}
                if poison_batches is not None:
                    row.update(application_properties=[("n", n)], time_to_live=None)
                batch_rows.append(row)
            if poison_batches is not None and b in poison_batches:
                for kind, poison in (("int", {"application_properties": [("n", 2**31)]}),
                                     ("ttl", {"time_to_live": -5}), ("null", {"body": None}),
                                     ("big", {"body": "x" * 300_000})):
                    key = f"p{b:02d}-{kind}"
                    self.keys.append(key)
                    # a property beyond 32 bits: rejected by the SDK's int encoding, or sent as an AMQP long
                    (self.edge if kind == "int" else self.poison).add(key)
                    batch_rows.append({"key": key, "body": f"poison {key}", "application_properties": None,
                                       "time_to_live": None, **poison})
            for f in range(FILES_PER_BATCH):
                part = [{**r, "entity": q} for r in batch_rows[f::FILES_PER_BATCH] for q in QUEUES]
                path = self.source / f"part-{b:03d}-{f}.parquet"
                pq.write_table(pa.Table.from_pylist(part, schema=schema), path)
                stamp = time.time() - 1000 + b  # the file source takes files in modification-time order
                os.utime(path, (stamp, stamp))
        say(f"  {self.name}: {len(self.keys)} keys x {len(QUEUES)} queues in {self.batches} batches"
            + (f" ({len(self.poison) + len(self.edge)} poison)" if self.poison else ""))

    # the writer

    def committed(self, batch: int, checkpoint: Path | None = None) -> bool:
        return ((checkpoint or self.checkpoint) / "commits" / str(batch)).exists()

    def in_flight(self, checkpoint: Path) -> int | None:
        """The batch whose offsets are written and whose commit is not (a batch running now), if any."""
        offsets = [int(p.name) for p in (checkpoint / "offsets").glob("[0-9]*") if p.name.isdigit()]
        if offsets and not self.committed(max(offsets), checkpoint):
            return max(offsets)
        return None

    def run_writer(self, hooks: dict[int, Callable[[], None]] | None = None, attempts: int = 6,
                   config: dict | None = None, on_failure: Callable[[int], None] | None = None) -> None:
        """Stream the input through the sink in this process; ``hooks[b]`` runs once when batch ``b`` first
        starts, before its rows are sent. A query that fails is restarted from its checkpoint (a supervisor),
        after ``on_failure(attempt)``."""
        spark, writer = self.bench.spark, self.bench.writer_job
        hooks, fired, holder = dict(hooks or {}), set(), {}
        last = self.batches - 1

        def each_batch(df: Any, batch_id: int) -> None:
            if batch_id in hooks and batch_id not in fired:
                fired.add(batch_id)
                hooks[batch_id]()
            s = holder["sink"](df, batch_id)
            self.finished.add(batch_id)
            say(f"  {self.name}: batch {batch_id}: {s.rows} rows, {s.primary} -> primary, {s.backlog_total} -> "
                f"backlog, {s.rejected} rejected, failovers {s.failovers}, failbacks {s.failbacks} [{s.seconds:.1f} s]")

        deadline = time.monotonic() + WRITER_TIMEOUT
        for attempt in range(1, attempts + 1):
            query, holder["sink"] = writer.start(spark, config or self.config, foreach_batch=each_batch,
                                                 checkpoint=str(self.checkpoint))
            while query.isActive and not self.committed(last) and time.monotonic() < deadline:
                time.sleep(0.2)
            done = self.committed(last)
            error = None if query.isActive else query.exception()
            _stop(query, self)
            if done:
                if attempt > 1:
                    self.note(f"writer done after {attempt} attempts")
                return
            if time.monotonic() >= deadline:
                self.result.flag("wedged", f"writer: batch {last} not committed after {WRITER_TIMEOUT:.0f} s "
                                           f"({attempt} attempts; {self._left()})")
                return
            self.note(f"writer attempt {attempt} failed: {_first_line(error)}; restarting from the checkpoint")
            if on_failure is not None:
                on_failure(attempt)
            time.sleep(1.0)
        self.result.flag("wedged", f"writer: gave up after {attempts} attempts ({self._left()})")

    def _left(self) -> str:
        done = sum(self.committed(b) for b in range(self.batches))
        return f"{done} of {self.batches} batches committed"

    def writer_conf(self) -> Path:
        path = self.work / "chaos.json"
        path.write_text(json.dumps(self.config))
        return path

    # the syphon

    def run_syphon(self, attempts: int = 3) -> None:
        """The syphon job in this process until the backlog is empty (restarted from its checkpoint when it
        fails)."""
        from spark_sb.config import load_config
        from spark_sb.source import backlog_depth

        spark, job = self.bench.spark, self.bench.syphon_job
        deadline = time.monotonic() + SYPHON_TIMEOUT
        for attempt in range(1, attempts + 1):
            query, republisher = job.start(spark, self.config, max_per_trigger=200, receive_timeout=0.5)
            try:
                job.await_until_empty(query, idle_batches=2, timeout=max(1.0, deadline - time.monotonic()),
                                      depth=functools.partial(backlog_depth, load_config(self.config)))
            except Exception as err:  # the query failed: awaitTermination raises its error
                self.note(f"syphon attempt {attempt} failed: {_first_line(err)}")
                _stop(query, self)
                time.sleep(1.0)
                continue
            say(f"  {self.name}: syphon: {republisher.totals or 'nothing to move'}")
            if time.monotonic() >= deadline:
                self.result.flag("wedged", f"syphon: the backlog not empty after {SYPHON_TIMEOUT:.0f} s")
            return
        self.result.flag("wedged", f"syphon: gave up after {attempts} attempts")

    # processes of their own

    def spawn(self, script: str, args: list[str], log: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
        env.update(SUBPROCESS_ENV)
        with (self.work / log).open("w") as out:
            return subprocess.Popen([sys.executable, str(JOBS / script), *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)

    def tail(self, log: str, lines: int = 5) -> str:
        text = (self.work / log).read_text(errors="replace").strip().splitlines()
        return " | ".join(line.strip()[:200] for line in text[-lines:])

    # the count

    def count(self) -> None:
        """Fill the result's counts from the emulator pair (peeked) and the reject table."""
        now = datetime.datetime.now(datetime.UTC)
        rejected = self._rejected()
        primary: dict[str, list[str]] = {}
        parked: collections.Counter[str] = collections.Counter()
        dead: collections.Counter[str] = collections.Counter()
        keys = set(self.keys)
        foreign = 0
        p, s, dlq = self.emu["primary"], self.emu["secondary"], ServiceBusSubQueue.DEAD_LETTER
        wanted = [(p, q, None) for q in QUEUES] + [(p, q, dlq) for q in QUEUES]
        wanted += [(s, q, sub) for q in self.backlog_queues for sub in (None, dlq)]
        with ThreadPoolExecutor(len(wanted)) as pool:  # opening and closing a receiver takes ~1 s
            peeked = list(pool.map(lambda w: _peek_all(w[0].connection_string, w[1], w[2]), wanted))
        for (namespace, queue, sub), found in zip(wanted, peeked, strict=True):
            if namespace is p and sub is None:
                ids = [str(m.message_id) for m in found]
                primary[queue] = [i for i in ids if i in keys]
                foreign += len(ids) - len(primary[queue])
            elif namespace is p:
                dead[queue] += len(found)
            else:
                entities = collections.Counter(messages.from_backlog(m, now).entity or "?" for m in found)
                (parked if sub is None else dead).update(entities)
        for q in QUEUES:
            got = set(primary[q])
            missing = keys - rejected[q] - got
            self.result.counts[q] = Counts(produced=len(keys), primary=len(primary[q]), backlog=parked[q],
                                           dead=dead[q], rejected=len(rejected[q]), lost=len(missing),
                                           duplicated=len(primary[q]) - len(got))
            if missing:
                self.note(f"{q}: lost {len(missing)}, e.g. {', '.join(sorted(missing)[:5])}")
            if rejected[q] - self.poison - self.edge:
                self.note(f"{q}: good rows rejected: {', '.join(sorted(rejected[q] - self.poison - self.edge))}")
            if self.poison - rejected[q]:
                self.note(f"{q}: poison rows not rejected: {', '.join(sorted(self.poison - rejected[q]))}")
            if self.edge:
                self.note(f"{q}: {len(self.edge & rejected[q])} rows with a property >= 2**31 rejected, "
                          f"{len(self.edge & got)} delivered")
        if foreign:
            self.note(f"{foreign} messages in the primary queues with ids not produced (pings?)")
        if parked["?"] or dead["?"]:
            self.note(f"backlog messages without a destination: {parked['?']} active, {dead['?']} dead-lettered")

    def _rejected(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {q: set() for q in QUEUES}
        table = self.config["sink"].get("reject_table")
        if not table or not Path(table).exists():
            return out
        rows = _delta_rows(Path(table), ["entity", "message_id"])
        for row in rows:
            out.setdefault(row["entity"], set()).add(str(row["message_id"]))
        if len(rows) != sum(len(ids) for ids in out.values()):
            self.note(f"the reject table holds {len(rows)} rows for {sum(len(i) for i in out.values())} ids")
        return out

    def close(self) -> None:
        self.emu.stop()


def _delta_rows(table: Path, columns: list[str]) -> list[dict]:
    """The rows of a Delta table (its live files, from the transaction log), read with pyarrow: counting needs
    no Spark job (and works when a wedged row still holds Spark)."""
    live: dict[str, bool] = {}
    for commit in sorted((table / "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line) if line.strip() else {}
            if "add" in action:
                live[action["add"]["path"]] = True
            elif "remove" in action:
                live.pop(action["remove"]["path"], None)
    rows: list[dict] = []
    for path in live:
        rows.extend(pq.read_table(table / urllib.parse.unquote(path), columns=columns).to_pylist())
    return rows


def _stop(query: Any, stage: Stage) -> None:
    try:
        query.stop()  # spark.sql.streaming.stopTimeout bounds it
    except Exception as err:
        stage.result.flag("wedged", f"query did not stop: {_first_line(err)}")


def _first_line(error: Any) -> str:
    """The line of an error worth a table note: the innermost ``module.SomeError: message`` line (Spark wraps
    the Python worker's error in its own), else the first line."""
    if error is None:
        return "stopped without an error"
    lines = [line.strip() for line in str(error).strip().splitlines()]
    named = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", line)]
    return (named[-1] if named else lines[0] if lines else type(error).__name__)[:240]


def _peek_all(conn_str: str, queue: str, sub_queue: Any = None) -> list[Any]:
    """Every message of ``queue`` (or its ``sub_queue``), peeked: nothing is locked or removed."""
    out: list[Any] = []
    with ServiceBusClient.from_connection_string(conn_str, retry_total=1) as client, \
            client.get_queue_receiver(queue, sub_queue=sub_queue) as receiver:
        seq = 0
        while page := receiver.peek_messages(max_message_count=250, sequence_number=seq, timeout=20):
            out.extend(page)
            seq = page[-1].sequence_number + 1
    return out


def _arrivals(stage: Stage) -> Callable[[], int]:
    """How many messages ``chaos-plain`` holds now (the admin API: a few ms, no receiver)."""
    primary = stage.emu["primary"]
    admin = admin_client(primary.connection_string, admin_endpoint=primary.admin_url)
    return lambda: admin.get_queue_runtime_properties(PLAIN).active_message_count


def _later(seconds: float, action: Callable[[], None], stage: Stage, what: str) -> None:
    """Run ``action`` on a thread after ``seconds`` (the hooks must not hold the batch up)."""

    def run() -> None:
        time.sleep(seconds)
        try:
            action()
        except Exception as err:
            stage.result.flag("crashed", f"{what} failed: {_first_line(err)}")

    threading.Thread(target=run, daemon=True, name=f"chaos-{what}").start()


# --- the faults: one function per row of the table ---------------------------------------------------------

FAULT_AT = 2  # the batch at which a fault starts
OUTAGE = 4.0  # seconds: longer than the failover interval (1 s)


def baseline(stage: Stage) -> None:
    stage.write_source()
    stage.run_writer()
    stage.run_syphon()


def _primary_fault(kind: str) -> Callable[[Stage], None]:
    def run(stage: Stage) -> None:
        stage.write_source()
        stage.run_writer({FAULT_AT: lambda: fault(stage.primary_admin, kind, duration=OUTAGE)})
        heal(stage.primary_admin)
        stage.run_syphon()

    run.__doc__ = f"The primary namespace '{kind}' for {OUTAGE:g} s from batch {FAULT_AT}."
    return run


primary_down = _primary_fault("down")
primary_timeout = _primary_fault("timeout")
primary_busy = _primary_fault("busy")
primary_disabled = _primary_fault("disabled")
primary_quota = _primary_fault("quota")


def backlog_queue_failing(stage: Stage) -> None:
    """The primary down and backlog queue 0 of the secondary down (entity fault) through the outage; the
    senders must use queue 1."""
    failing = stage.backlog_queues[0]

    def start() -> None:
        fault(stage.secondary_admin, "down", entity=failing)
        fault(stage.primary_admin, "down", duration=OUTAGE)

    stage.write_source()
    stage.run_writer({FAULT_AT: start})
    heal(stage.secondary_admin, entity=failing)
    heal(stage.primary_admin)
    stage.note(f"failing backlog queue: {failing}")
    stage.run_syphon()


def backlog_all_failing(stage: Stage) -> None:
    """The primary and the whole secondary down from batch 2: the batch fails (after Spark's four tries of its
    tasks); the supervisor restarts the query from its checkpoint; after the second failed attempt the
    secondary is healed (the batch goes to the backlog), and the primary 4 s later."""

    def start() -> None:
        fault(stage.secondary_admin, "down")
        fault(stage.primary_admin, "down")

    def on_failure(attempt: int) -> None:
        if attempt == 2:
            heal(stage.secondary_admin)
            stage.note("secondary healed")
            _later(OUTAGE, lambda: heal(stage.primary_admin), stage, "primary heal")

    stage.write_source()
    stage.run_writer({FAULT_AT: start}, attempts=6, on_failure=on_failure)
    if not any("failed" in n for n in stage.result.notes):
        stage.result.flag("crashed", "the batch never failed: the fault did not bite")
    heal(stage.secondary_admin)
    heal(stage.primary_admin)
    stage.run_syphon()


def worker_killed(stage: Stage) -> None:
    """SIGKILL a ``pyspark.daemon`` worker while it sends batch 3 (a big batch: 2,500 more keys, 20 messages a
    send): the first worker seen busy, 0.3 s later. Spark retries the task (``local[2,4]``)."""
    kill_at = 3
    killed: dict[str, Any] = {}

    def kill() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and kill_at not in stage.finished:
            pid, busy = _busiest_worker()
            if pid is not None and busy >= 3:  # >= 30 ms of CPU in 100 ms: running a task
                time.sleep(0.3)
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, busy=busy, mid_batch=kill_at not in stage.finished)
                return
        stage.result.flag("crashed", f"no busy pyspark.daemon worker found while batch {kill_at} ran")

    stage.write_source(big={kill_at: 2500})
    config = {**stage.config, "sink": {**stage.config["sink"], "chunk_size": 20}}
    stage.run_writer({kill_at: lambda: _later(0.0, kill, stage, "worker kill")}, config=config)
    if killed:
        stage.note(f"killed worker {killed['pid']} ({'before' if killed['mid_batch'] else 'AFTER'} batch {kill_at} "
                   f"was done; cpu ticks in 0.1 s: {killed['busy']})")
    stage.run_syphon()


def writer_killed(stage: Stage) -> None:
    """``jobs/paired_writer.py`` in its own process; the primary goes down for a few seconds when batch 2 runs,
    and the writer (its whole process group: driver, JVM, Python workers) is SIGKILLed while batch 4 runs, then
    restarted on the same checkpoint."""
    stage.write_source()
    args = ["--conf", str(stage.writer_conf()), "--max-batches", str(stage.batches)]
    first = stage.spawn("paired_writer.py", args, "writer-1.log")
    killed_in, faulted = None, False
    deadline = time.monotonic() + WRITER_TIMEOUT
    try:
        while first.poll() is None and time.monotonic() < deadline:
            running = stage.in_flight(stage.checkpoint)
            if running is not None and running >= FAULT_AT and not faulted:
                fault(stage.primary_admin, "down", duration=OUTAGE)
                faulted = True
            if running is not None and running >= FAULT_AT + 2:
                time.sleep(0.3)
                killed_in = running
                break
            time.sleep(0.05)
    finally:
        _kill_group(first)
    if killed_in is None:
        stage.result.flag("crashed", f"the first writer did not reach batch {FAULT_AT + 2}: "
                                     f"{stage.tail('writer-1.log')}")
    else:
        stage.note(f"writer SIGKILLed in batch {killed_in} ({stage._left()})")
    _supervise(stage, "paired_writer.py", args, "writer", lambda: stage.committed(stage.batches - 1),
               WRITER_TIMEOUT)
    heal(stage.primary_admin)
    stage.run_syphon()


def emulator_killed(stage: Stage) -> None:
    """kill -9 the emulator pair (both namespaces: the batch fails until it is back) as soon as copies of batch
    2 (a big batch: 1,500 more keys) reach the primary; restart it 2 s later on the same ports and data dir."""
    arrived = _arrivals(stage)

    def restart() -> None:
        stage.emu = stage.emu.restart()
        stage.note("emulator restarted")

    def kill() -> None:
        base, deadline = arrived(), time.monotonic() + 10
        while (n := arrived() - base) <= 0 and FAULT_AT not in stage.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        stage.emu.kill()
        stage.note(f"emulator killed (-9) {'during' if FAULT_AT not in stage.finished else 'AFTER'} batch "
                   f"{FAULT_AT}, {n} of its copies in {PLAIN}")
        _later(2.0, restart, stage, "emulator restart")

    stage.write_source(big={FAULT_AT: 1500})
    stage.run_writer({FAULT_AT: lambda: _later(0.0, kill, stage, "emulator kill")}, attempts=10)
    stage.run_syphon()


def syphon_killed(stage: Stage) -> None:
    """The writer parks most rows (the primary down from batch 1 to the end), then ``jobs/syphon.py`` in its
    own process (50 messages a batch) is SIGKILLed after its first batch log line, in a later batch as soon as
    that batch's copies reach the primary (before its ledger append), and restarted on the same checkpoint
    and ledger until the backlog is empty."""
    stage.config["syphon"]["max_messages_per_trigger"] = 50
    stage.write_source()
    stage.run_writer({1: lambda: fault(stage.primary_admin, "down")})
    heal(stage.primary_admin)
    checkpoint = Path(stage.config["syphon"]["checkpoint_location"])
    args = ["--conf", str(stage.writer_conf()), "--until-empty"]
    arrived = _arrivals(stage)
    first = stage.spawn("syphon.py", args, "syphon-1.log")
    deadline = time.monotonic() + SYPHON_TIMEOUT
    killed_in, base = None, None
    try:
        while first.poll() is None and time.monotonic() < deadline and killed_in is None:
            if base is None and "syphon batch " in (stage.work / "syphon-1.log").read_text(errors="replace"):
                base = arrived()  # batch 0 is done
            if base is not None and arrived() > base:  # a later batch is republishing
                killed_in = stage.in_flight(checkpoint)
                break
            time.sleep(0.01)
    finally:
        _kill_group(first)
    ledger = Path(stage.config["syphon"]["ledger"])
    recorded = len(_delta_rows(ledger, ["message_id"])) if (ledger / "_delta_log").exists() else 0
    if killed_in is None:
        stage.result.flag("crashed", f"the first syphon was not killed mid-batch (exit {first.returncode}): "
                                     f"{stage.tail('syphon-1.log')}")
    else:
        stage.note(f"syphon SIGKILLed in batch {killed_in} once {PLAIN} had {arrived() - base} of its copies "
                   f"({recorded} ledger rows)")
    _supervise(stage, "syphon.py", args, "syphon", None, SYPHON_TIMEOUT + 100)  # + a dead attempt's locks (60 s)


def poison_rows(stage: Stage) -> None:
    """Bad rows in batches 1-5 (the primary down from batch 2): a negative TTL (the SDK cannot encode it), a
    null body, a 300 KB body (over the 256 KiB limit), and a property value >= 2**31 in a map<string,bigint>
    (rejected, or sent as an AMQP long); with ``sink.reject_table``: rejected, the stream goes on, nothing else
    lost."""
    stage.config["sink"]["reject_table"] = str(stage.work / "rejects")
    stage.write_source(poison_batches=range(1, min(6, stage.batches)))
    stage.run_writer({FAULT_AT: lambda: fault(stage.primary_admin, "down", duration=OUTAGE)})
    heal(stage.primary_admin)
    stage.run_syphon()


@dataclass(frozen=True)
class Fault:
    name: str
    title: str
    run: Callable[[Stage], None]


FAULTS = (
    Fault("baseline", "no fault", baseline),
    Fault("primary-down", "primary down", primary_down),
    Fault("primary-timeout", "primary timeout", primary_timeout),
    Fault("primary-busy", "primary busy", primary_busy),
    Fault("primary-disabled", "primary disabled", primary_disabled),
    Fault("primary-quota", "primary quota", primary_quota),
    Fault("backlog-queue-failing", "one backlog queue failing", backlog_queue_failing),
    Fault("backlog-all-failing", "every backlog queue failing", backlog_all_failing),
    Fault("worker-killed", "Python worker killed mid-partition", worker_killed),
    Fault("writer-killed", "writer killed and restarted", writer_killed),
    Fault("emulator-killed", "emulator kill -9 and restart", emulator_killed),
    Fault("syphon-killed", "syphon killed mid-batch", syphon_killed),
    Fault("poison-rows", "poison rows (reject table)", poison_rows),
)


# --- process helpers ---------------------------------------------------------------------------------------


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process this bench started and everything in its session (its JVM and Python workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def _supervise(stage: Stage, script: str, args: list[str], what: str, done: Callable[[], bool] | None,
               timeout: float, attempts: int = 3) -> None:
    """Run a job in its own process until ``done()`` (or, without ``done``, until it exits 0), restarting it
    when it exits early, as a job scheduler would; stopped and reported wedged after ``timeout``."""
    deadline = time.monotonic() + timeout
    for attempt in range(2, attempts + 2):
        log = f"{what}-{attempt}.log"
        proc = stage.spawn(script, args, log)
        try:
            while proc.poll() is None and time.monotonic() < deadline and not (done and done()):
                time.sleep(0.2)
            if done is not None and done():
                proc.wait(max(1.0, min(30.0, deadline - time.monotonic())))  # it stops by itself (--max-batches)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                _kill_group(proc)
        if (done() if done else proc.returncode == 0):
            return
        if time.monotonic() >= deadline:
            stage.result.flag("wedged", f"{what} run {attempt} did not finish in {timeout:.0f} s: {stage.tail(log)}")
            return
        stage.note(f"{what} run {attempt} exited with {proc.returncode}: {stage.tail(log, 2)}")
    stage.result.flag("wedged", f"{what}: gave up after {attempts} restarts")


def _proc_table() -> dict[int, tuple[int, str, int]]:
    """{pid: (ppid, cmdline, cpu ticks)} of every process we can read."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]), cmdline, int(fields[11]) + int(fields[12]))
    return out


def _busiest_worker() -> tuple[int | None, int]:
    """The ``pyspark.daemon`` worker (a fork of this process's JVM's daemon) that used the most CPU in 0.1 s."""
    table = _proc_table()

    def ours(pid: int) -> bool:
        while pid > 1 and pid in table:
            if pid == os.getpid():
                return True
            pid = table[pid][0]
        return False

    daemons = {pid for pid, (ppid, cmd, _) in table.items()
               if "pyspark.daemon" in cmd and "pyspark.daemon" not in table.get(ppid, (0, "", 0))[1] and ours(pid)}
    workers = [pid for pid, (ppid, _, _) in table.items() if ppid in daemons]
    if not workers:
        return None, 0
    time.sleep(0.1)
    after = _proc_table()
    busy = {pid: after[pid][2] - table[pid][2] for pid in workers if pid in after}
    pid = max(busy, key=busy.get) if busy else workers[0]
    return pid, busy.get(pid, 0)


# --- the bench ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, work: Path, rows: int, batches: int, verbose: bool) -> None:
        self.work = work
        self.rows = rows
        self.batches = batches
        self.writer_job = _job("paired_writer")
        self.syphon_job = _job("syphon")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # loopback only (Spark would take the host's address)
        say(f"starting Spark ({MASTER}, Delta)")
        self.spark = self.writer_job.build_session("spark-sb-chaos", master=MASTER)
        self.spark.sparkContext.setLogLevel("WARN" if verbose else "FATAL")
        for key, value in {"spark.sql.streaming.schemaInference": "true",  # the writer job reads parquet as is
                           "spark.sql.streaming.stopTimeout": "30s",  # a wedged query cannot hang stop()
                           "spark.sql.streaming.noDataProgressEventInterval": "1s"}.items():  # the syphon's idle test
            self.spark.conf.set(key, value)

    def run(self, spec: Fault) -> RowResult:
        result = RowResult(spec.name, spec.title)
        started = time.monotonic()
        say(f"== {spec.name}: {spec.title}")
        stage: Stage | None = None
        box: dict[str, Stage] = {}

        def body() -> None:
            box["stage"] = Stage(self, spec.name, self.work / spec.name, result)
            spec.run(box["stage"])

        def guarded() -> None:
            try:
                body()
            except Exception as err:
                result.flag("crashed", f"{type(err).__name__}: {_first_line(err)}")
                traceback.print_exc()

        thread = threading.Thread(target=guarded, daemon=True, name=f"chaos-{spec.name}")
        thread.start()
        thread.join(ROW_BUDGET)
        stage = box.get("stage")
        if thread.is_alive():
            result.flag("wedged", f"the row did not finish in {ROW_BUDGET:.0f} s")
            for query in self.spark.streams.active:
                try:
                    query.stop()
                except Exception:
                    pass
        if stage is not None:
            counted = time.monotonic()
            try:
                stage.count()
            except Exception as err:
                result.flag("crashed", f"counting failed: {type(err).__name__}: {_first_line(err)}")
            closed = time.monotonic()
            stage.close()
            say(f"  {spec.name}: counted in {closed - counted:.1f} s, emulator stopped in "
                f"{time.monotonic() - closed:.1f} s")
        result.seconds = time.monotonic() - started
        c = result.counts
        say(f"== {spec.name}: {result.status}, lost {c[DEDUP].lost}/{c[PLAIN].lost}, duplicated "
            f"{c[DEDUP].duplicated}/{c[PLAIN].duplicated} (dedup on/off) [{result.seconds:.0f} s]")
        return result

    def close(self) -> None:
        started = time.monotonic()
        self.spark.stop()
        say(f"Spark stopped in {time.monotonic() - started:.1f} s")


def table(results: list[RowResult]) -> str:
    head = ("| # | fault | result | produced | in primary | in backlog | dead-lettered | rejected | lost | "
            "duplicated | s |")
    lines = [head, "|" + "---|" * 11]
    for n, r in enumerate(results, 1):
        def pair(attr: str, r: RowResult = r) -> str:
            a, b = getattr(r.counts[DEDUP], attr), getattr(r.counts[PLAIN], attr)
            return f"{a} / {b}"
        lines.append(f"| {n} | {r.title} | {r.status} | {pair('produced')} | {pair('primary')} | "
                     f"{pair('backlog')} | {pair('dead')} | {pair('rejected')} | {pair('lost')} | "
                     f"{pair('duplicated')} | {r.seconds:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=320, help="input keys per row of the table")
    parser.add_argument("--batches", type=int, default=8, help="batches per stream")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=[f.name for f in FAULTS],
                        help="run only these rows: " + ", ".join(f.name for f in FAULTS))
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints, data)")
    parser.add_argument("-v", "--verbose", action="store_true", help="Spark's warnings too")
    args = parser.parse_args()
    if args.batches < 6:
        parser.error("--batches must be at least 6")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("spark_sb.republisher").setLevel(logging.INFO)  # one line per syphon batch, with step timings
    logging.getLogger("py4j").setLevel(logging.CRITICAL)  # a failed batch's traceback: the note has its error
    work = Path(tempfile.mkdtemp(prefix="spark-sb-chaos-"))
    say(f"work folder {work}")
    bench = Bench(work, args.rows, args.batches, args.verbose)
    results = []
    try:
        for spec in FAULTS:
            if args.only is None or spec.name in args.only:
                results.append(bench.run(spec))
    finally:
        bench.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print("counts: duplicate detection on / off (chaos-dedup / chaos-plain)")
    print()
    print(table(results))
    print()
    for n, r in enumerate(results, 1):
        for note in r.notes:
            print(f"- {n} {r.name}: {note}")
    lost = [r.name for r in results if r.lost]
    duplicated = [r.name for r in results if r.counts[DEDUP].duplicated]
    unwell = [f"{r.name} ({r.status})" for r in results if r.status != "ok"]
    print()
    print(f"lost 0 in every row: {'yes' if not lost else 'NO (' + ', '.join(lost) + ')'}; "
          f"duplicated 0 with duplicate detection on in every row: "
          f"{'yes' if not duplicated else 'NO (' + ', '.join(duplicated) + ')'}; "
          f"wedged or crashed: {', '.join(unwell) or 'none'}; {time.monotonic() - _STARTED:.0f} s")
    return 1 if lost else 2 if duplicated or unwell else 0


if __name__ == "__main__":
    sys.exit(main())
