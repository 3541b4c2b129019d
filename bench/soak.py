"""The soak run (issue 22): a known, growing input streamed through the sink for many minutes while a seeded
nemesis overlaps faults at random, then every message accounted for.

    flock /tmp/spark.lock .venv/bin/python bench/soak.py [--minutes 30] [--seed S] [--modes paired active]
    flock /tmp/spark.lock .venv/bin/python bench/soak.py --outage 10     # one long outage instead of the nemesis

Each mode gets a fresh world: two emulator processes (the primary and the secondary namespace, each its own
process, data dir and ports, so either can be killed with ``kill -9`` and restarted alone), two primary queues,
``soak-dedup`` (duplicate detection, a two-hour window) and ``soak-plain`` (none), a producer that writes one
parquet file of ``--rate`` new keys every second (each key once per queue; the key is the message id), and
Service Bus's habits on both namespaces (``--idle-detach``, ``--detach-every``: links detached with
``amqp:link:detach-forced``), and jobs in processes of their own, each restarted by a supervisor whenever it
exits, as a job scheduler would:

* the writer (``jobs/paired_writer.py``: ``foreachBatch(PairedSink)``), in both modes;
* paired mode: the syphon (``jobs/syphon.py``), moving the backlog home beside the writer;
* active mode: a reader (this script, ``--reader``): ``format("servicebus")`` over both namespaces through
  ``spark_sb.dedupe`` into one Delta table per queue.

The nemesis draws from ``random.Random(seed)`` for ``--minutes`` (split evenly over the modes): a namespace
fault (down, timeout, busy, ack-lost, disabled) on either namespace for 2 to 60 s; either emulator killed with
``kill -9`` and restarted 1 to 8 s later; a Python worker of the writer, the writer or the syphon (the reader)
killed with SIGKILL; a quiet spell of 20 to 60 s; 2 to 20 s between draws, so faults overlap. Every draw is
logged with its time (``faults.jsonl`` in the work folder, and on the console): the same seed draws the same
schedule. Then the producer stops, everything is healed, the jobs drain (``--drain-minutes``), and the queues
are counted: produced, in the primary (paired) or read (active), lost, duplicated, left in the backlog or the
namespaces, dead-lettered with reasons, faults by kind, restarts.

``--token-lifetime D``: both namespaces reached with Entra ID instead of SAS: a managed identity whose tokens
live ``D`` (say 60s) from a third emulator process that plays the token endpoint and is never faulted, so that
every job's clients renew their tokens all along (the SDK's own SAS tokens last an hour, longer than a mode).

``--sessions N`` (issue 38): sessions keep their order. Both primary queues require sessions; every key belongs
to one of N sessions (key number ``n``: session ``s<(n-1) % N>``, sequence number ``(n-1) // N`` in the body and
the application property ``seq``), and each input file holds its rows in key order. The writer reads one file per
batch (``maxFilesPerTrigger`` 1: a batch is one partition, so a session's rows are in one partition in order, as
the guarantee requires; several small files in one batch would be packed into partitions by size, not in order),
and the producer writes a file every 2 s (``--rate`` x 2 keys) so the writer keeps up. After the count, every
session of every queue is received from the primary with a session receiver, and a message whose sequence
number is lower than one received before it in its session (duplicates aside) is an order violation: reported
per queue (messages and sessions out of order) and, for each run of them, the session, the positions and
sequence numbers, when they and the message they should have preceded reached the primary, whether each was seen
parked in the backlog (a watcher peeks the backlog queues every 2 s), which faults were active, and whose rule
broke: the syphon's (both parked, moved home out of order) or the sender's (the later message sent to the primary
while its session had messages parked). The jobs' JVM console (where the executors' Python warnings go) is kept
beside their logs.

``--outage M``: paired mode, no nemesis: two healthy minutes, the primary down for M minutes under the same
steady input, two healthy minutes, then the drain. It reports the sink's batch durations healthy and failed
over (from the writer's log) and how long the syphon took to bring the backlog home, at what rate.

``--sessions`` also reports every send a session held (``send_availability.session_order: strict``: the backlog
could neither say whether the session had messages parked nor take its messages, so the task failed; Spark tries
it again, then fails the batch, which is replayed), from the writer's JVM console (each failed task attempt with
its time and error): when, the primary's faults in force meanwhile (a killed emulator until it was up again),
whether the watcher saw a message of the held sessions parked then, and how many were held while the primary was
healthy and nothing of their sessions was parked.

Exit code: 1 when anything was lost or (``--sessions``) a session is out of order on the primary or a send was
held while the primary was healthy and nothing of its sessions was parked, 2 when nothing was lost but a queue
with duplicate detection (or the deduplicated read) holds a duplicate or a mode did not drain in time, else 0.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import logging
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from azure.servicebus import ServiceBusClient, ServiceBusReceiveMode, ServiceBusSubQueue

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import SUBPROCESS_ENV, _delta_rows, _first_line, _kill_group, _peek_all, _proc_table  # noqa: E402

from spark_sb import messages  # noqa: E402
from spark_sb.durations import parse_seconds  # noqa: E402
from spark_sb.emulator import EmulatorProcess, NamespaceOptions, fault, heal  # noqa: E402
from spark_sb.emulator.aad import DEFAULT_IDENTITY_HEADER  # noqa: E402
from spark_sb.emulator.server import send_control  # noqa: E402
from spark_sb.paired import PairedSender  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
DEDUP, PLAIN = "soak-dedup", "soak-plain"
QUEUES = (DEDUP, PLAIN)
ENTITIES = f"""
queues:
  - name: {DEDUP}
    requires_duplicate_detection: true
    duplicate_detection_history_time_window: 2h
  - name: {PLAIN}
"""
# --sessions: both primary queues require sessions
SESSION_ENTITIES = f"""
queues:
  - name: {DEDUP}
    requires_duplicate_detection: true
    duplicate_detection_history_time_window: 2h
    requires_session: true
  - name: {PLAIN}
    requires_session: true
"""
SIDES = ("primary", "secondary")
NAMESPACE_FAULTS = ("down", "timeout", "busy", "ack-lost", "disabled")
DEDUPE_WINDOW = "2 hours"

_STARTED = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {text}", flush=True)


# --- the world of one mode ------------------------------------------------------------------------------


def session_of(key_number: int, sessions: int) -> tuple[str, int]:
    """Key ``k<key_number>``'s session and its sequence number in that session (``--sessions``)."""
    return f"s{(key_number - 1) % sessions:02d}", (key_number - 1) // sessions


@dataclass
class Result:
    mode: str
    produced: int = 0
    arrived: dict[str, int] = field(default_factory=dict)  # per queue: in the primary (paired) / read (active)
    lost: dict[str, int] = field(default_factory=dict)
    duplicated: dict[str, int] = field(default_factory=dict)
    left: int = 0  # in the backlog (paired) or unread in either namespace (active)
    dead: collections.Counter = field(default_factory=collections.Counter)  # reason -> count
    faults: collections.Counter = field(default_factory=collections.Counter)  # kind -> count
    restarts: collections.Counter = field(default_factory=collections.Counter)  # job -> count
    failed: collections.Counter = field(default_factory=collections.Counter)  # job -> runs that failed, not killed
    drained: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # --sessions: per queue, messages received out of order on the primary, and sessions holding one
    out_of_order: dict[str, int] = field(default_factory=dict)
    sessions_out: dict[str, int] = field(default_factory=dict)
    events: list[tuple[float, str, dict]] = field(default_factory=list)  # (wall time, kind, detail): the faults
    # --sessions: task attempts a session send held (strict), and of them those held while the primary was healthy
    # and nothing of their sessions was parked
    held: int = 0
    held_healthy: int = 0


class World:
    """Two emulator processes, the input folder, the configuration and the supervised jobs of one mode."""

    def __init__(self, work: Path, mode: str, rate: int, habits: dict[str, float],
                 token_lifetime: float | None = None, sessions: int = 0) -> None:
        self.work, self.mode, self.rate = work, mode, rate
        self.sessions = sessions
        self.entra = token_lifetime is not None
        work.mkdir(parents=True)
        (work / "entities.yaml").write_text(SESSION_ENTITIES if sessions else ENTITIES)
        self.emu = {side: EmulatorProcess.start(data_dir=work / f"emulator-{side}", entities=work / "entities.yaml",
                                                namespaces=[NamespaceOptions(side, **habits)],
                                                log_file=work / f"emulator-{side}.log", token_lifetime=token_lifetime,
                                                entra_id=self.entra)
                    for side in SIDES}
        self.emu_lock = {side: threading.Lock() for side in SIDES}
        #: each emulator killed: (side, wall time killed, wall time back up or healed)
        self.down_spells: list[tuple[str, float, float]] = []
        self.source = work / "source"
        self.source.mkdir()
        self.files: list[str] = []  # the input files, in order
        self.file_times: list[float] = []  # when each was written (wall time)
        self.keys = 0
        self.stop = threading.Event()  # ends the producer
        self.config = self._config()
        self.conf_path = work / "soak.json"
        self.conf_path.write_text(json.dumps(self.config))
        self.backlog_queues: tuple[str, ...] = ()
        if mode == "paired":
            with PairedSender.from_config(self.config) as sender:
                sender.pair()  # the syphon reads every backlog queue from its start
                self.backlog_queues = tuple(sender.backlog_queues)
        self.jobs: dict[str, Job] = {}

    def info(self, side: str) -> Any:
        return self.emu[side][side]

    def _config(self) -> dict:
        namespaces = {side: self._namespace(self.info(side)) for side in SIDES}
        config = {
            **namespaces,
            "send_availability": {"backlog_queue_count": 4, "failover_interval": "2s", "ping_primary_interval": "2s",
                                  "backlog_prefix": "soak", "primary_try_timeout": "5s"},
            "sink": {"entity": DEDUP, "key_column": "key", "chunk_size": 100, "trigger": "1s",
                     "checkpoint_location": str(self.work / "writer-checkpoint"),
                     "source": {"format": "parquet", "path": str(self.source),
                                "options": {"maxFilesPerTrigger": "10"}}},
            "syphon": {"retry_interval": "2s", "receive_batch": 100,
                       "checkpoint_location": str(self.work / "syphon-checkpoint"),
                       "ledger": str(self.work / "ledger")},
        }
        if self.mode == "active":
            config["replication"] = {"mode": "active", "retry_interval": "2s"}
        if self.sessions:  # one file a batch: one partition, each session's rows in it in order
            config["sink"]["source"]["options"]["maxFilesPerTrigger"] = "1"
        return config

    def _namespace(self, info: Any) -> dict:
        """A namespace of the configuration: its connection string (SAS), or with ``--token-lifetime`` a
        managed identity whose tokens the identity emulator issues (``IDENTITY_ENDPOINT``)."""
        if self.entra:
            return {"fully_qualified_namespace": f"localhost:{info.amqp_port}", "emulator": True,
                    "admin_endpoint": info.admin_url, "credential": {"type": "managed_identity"}}
        return {"connection_string": info.connection_string, "admin_endpoint": info.admin_url}

    # the producer

    def produce(self) -> None:
        """One parquet file of ``rate`` new keys a second until ``stop`` (written aside, then renamed: the file
        source never sees half a file); with sessions, one file of ``2 * rate`` keys every 2 s, each row with
        its session id and its sequence number in the session (:func:`session_of`)."""
        fields = [pa.field("key", pa.string()), pa.field("body", pa.string()), pa.field("entity", pa.string())]
        if self.sessions:
            fields += [pa.field("session_id", pa.string()),
                       pa.field("application_properties", pa.map_(pa.string(), pa.int64()))]
        schema = pa.schema(fields)
        period = 2.0 if self.sessions else 1.0
        while not self.stop.is_set():
            started = time.monotonic()
            rows = []
            for _ in range(int(self.rate * period)):
                self.keys += 1
                key = f"k{self.keys:07d}"
                if self.sessions:
                    session, seq = session_of(self.keys, self.sessions)
                    rows += [{"key": key, "body": f"row {key} {session}#{seq}", "entity": q, "session_id": session,
                              "application_properties": [("seq", seq)]} for q in QUEUES]
                else:
                    rows += [{"key": key, "body": f"row {key}", "entity": q} for q in QUEUES]
            name = f"part-{len(self.files):06d}.parquet"
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), self.source / f".{name}.tmp")
            os.rename(self.source / f".{name}.tmp", self.source / name)
            self.files.append(name)
            self.file_times.append(time.time())
            self.stop.wait(max(0.0, period - (time.monotonic() - started)))

    def written(self) -> set[str]:
        """The input files in batches the writer committed (its file source's log and its commits)."""
        checkpoint = Path(self.config["sink"]["checkpoint_location"])
        # Spark keeps the last 100 commits and compacts the source's log every 10 batches: a batch is committed
        # when a later one is
        commits = [int(p.name) for p in (checkpoint / "commits").glob("[0-9]*") if p.name.isdigit()]
        last = max(commits, default=-1)
        done: set[str] = set()
        for log in (checkpoint / "sources" / "0").glob("[0-9]*"):
            try:
                text = log.read_text(errors="replace")
            except FileNotFoundError:  # deleted by Spark's cleanup meanwhile
                continue
            for line in text.splitlines():
                if line.startswith("{"):
                    entry = json.loads(line)
                    if entry.get("batchId", last + 1) <= last:
                        done.add(Path(entry["path"]).name)
        return done

    # the emulators

    def kill_emulator(self, side: str, down_for: float) -> bool:
        if not self.emu_lock[side].acquire(blocking=False):
            return False  # already down

        def run() -> None:
            killed = time.time()
            try:
                self.emu[side].kill()
                time.sleep(down_for)
                self.emu[side] = self.emu[side].restart()
            except Exception as err:
                say(f"  {side} emulator restart failed: {_first_line(err)}")
            finally:
                self.down_spells.append((side, killed, time.time()))
                self.emu_lock[side].release()

        threading.Thread(target=run, daemon=True, name=f"soak-kill-{side}").start()
        return True

    def heal_all(self) -> None:
        for side in SIDES:
            with self.emu_lock[side]:  # waits out a restart in progress
                if self.emu[side].proc.poll() is not None:
                    self.emu[side] = self.emu[side].restart()
                heal(self.info(side).admin_url)

    def close(self) -> None:
        for job in self.jobs.values():
            job.halt()
        for emu in self.emu.values():
            emu.stop()


class Job:
    """A job in its own process (and session: its JVM and Python workers), restarted whenever it exits until
    ``halt``; ``restarts`` counts them."""

    def __init__(self, world: World, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.world, self.name, self.argv = world, name, argv
        self.env = env or {}  # over SUBPROCESS_ENV (bench/cluster_soak.py: the cluster's master, Spark settings)
        self.proc: subprocess.Popen | None = None
        self.runs = 0
        self.failed: list[str] = []  # runs that ended by themselves (not killed): their last error line
        self.halted = threading.Event()
        self.thread = threading.Thread(target=self._supervise, daemon=True, name=f"soak-{name}")
        self.thread.start()

    def _spawn(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
        env.update(SUBPROCESS_ENV)
        env.update(self.env)
        self.runs += 1
        # the JVM's console (Spark's log lines, the executors' Python warnings in local mode) beside the job's log
        env["SPARK_SB_JVM_LOG"] = str(self.world.work / f"{self.name}-{self.runs}.jvm.log")
        with (self.world.work / f"{self.name}-{self.runs}.log").open("w") as out:
            return subprocess.Popen([sys.executable, *self.argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, cwd=ROOT)

    def _supervise(self) -> None:
        while not self.halted.is_set():
            self.proc = self._spawn()
            while self.proc.poll() is None and not self.halted.is_set():
                time.sleep(0.2)
            if self.halted.is_set():
                break
            say(f"  {self.name} run {self.runs} exited with {self.proc.returncode}: {self.tail()}")
            if self.proc.returncode != -signal.SIGKILL:
                self.failed.append(self.tail())
            self.halted.wait(2.0)

    @property
    def restarts(self) -> int:
        return max(0, self.runs - 1)

    def tail(self, lines: int = 1) -> str:
        text = (self.world.work / f"{self.name}-{self.runs}.log").read_text(errors="replace").strip().splitlines()
        named = [t for t in text if re.search(r"(Error|Exception)\b", t)]
        return " | ".join(line.strip()[:200] for line in (named or text)[-lines:])

    def kill(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        _kill_group(self.proc)
        return True

    def halt(self) -> None:
        self.halted.set()
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc)
        self.thread.join(30)

    def workers(self) -> list[int]:
        """The Python workers (forks of ``pyspark.daemon``) of this job's process tree."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        table = _proc_table()

        def under(pid: int) -> bool:
            while pid > 1 and pid in table:
                if pid == self.proc.pid:
                    return True
                pid = table[pid][0]
            return False

        return [pid for pid, (ppid, cmd, _) in table.items()
                if "pyspark.daemon" in cmd and "pyspark.daemon" in table.get(ppid, (0, "", 0))[1] and under(pid)]


# --- the nemesis ----------------------------------------------------------------------------------------


class Nemesis:
    """Seeded random faults, overlapping, for ``seconds``; each logged with its time."""

    def __init__(self, world: World, rng: random.Random, seconds: float, log: Path, result: Result) -> None:
        self.world, self.rng, self.seconds, self.log, self.result = world, rng, seconds, log, result
        self.started = time.monotonic()

    def record(self, kind: str, **detail: Any) -> None:
        at = time.monotonic() - self.started
        entry = {"mode": self.world.mode, "at": round(at, 1), "kind": kind, **detail}
        with self.log.open("a") as out:
            out.write(json.dumps(entry) + "\n")
        if not detail.get("skipped"):
            self.result.faults[kind] += 1
            self.result.events.append((time.time(), kind, detail))
        say(f"  nemesis +{at:6.1f}s {kind} {json.dumps(detail)}")

    #: what the nemesis draws from (equally likely draws)
    KINDS = ["namespace"] * 10 + ["emulator-killed", "worker-killed", "writer-killed", "job-killed"] + ["quiet"] * 2

    def run(self) -> None:
        rng = self.rng
        kinds = self.KINDS
        while time.monotonic() - self.started < self.seconds:
            kind = rng.choice(kinds)
            side = rng.choice(SIDES)
            what = rng.choice(NAMESPACE_FAULTS)
            length = round(rng.uniform(2, 60), 1)
            pause = round(rng.uniform(1, 8), 1)
            gap = round(rng.uniform(2, 20), 1)
            pick = rng.random()
            try:
                self._one(kind, side, what, length, pause, pick)
            except Exception as err:  # an emulator being restarted: the draw is skipped, the schedule goes on
                self.record(kind if kind != "namespace" else f"{side} {what}", skipped=_first_line(err))
            if kind == "quiet":
                gap += round(rng.uniform(20, 60), 1)
            time.sleep(min(gap, max(0.0, self.seconds - (time.monotonic() - self.started))))

    def _one(self, kind: str, side: str, what: str, length: float, pause: float, pick: float) -> None:
        world = self.world
        if kind == "namespace":
            if world.emu_lock[side].locked():
                raise ConnectionError(f"the {side} emulator is down")
            fault(world.info(side).admin_url, what, duration=length)
            self.record(f"{side} {what}", seconds=length)
        elif kind == "emulator-killed":
            done = world.kill_emulator(side, pause)
            self.record(f"{side} emulator killed", down_for=pause, **({} if done else {"skipped": "already down"}))
        elif kind == "worker-killed":
            workers = world.jobs["writer"].workers()
            if not workers:
                self.record(kind, skipped="no Python worker running")
                return
            pid = sorted(workers)[int(pick * len(workers))]
            os.kill(pid, signal.SIGKILL)
            self.record(kind, pid=pid, of=len(workers))
        elif kind in ("writer-killed", "job-killed"):
            job = world.jobs["writer" if kind == "writer-killed" else "syphon" if world.mode == "paired" else "reader"]
            done = job.kill()
            self.record(f"{job.name} killed", **({} if done else {"skipped": "not running"}))
        else:
            self.record("quiet")


def outage(world: World, minutes: float, log: Path, result: Result) -> dict[str, float]:
    """Two healthy minutes, the primary down for ``minutes``, two healthy minutes; returns the times."""
    nemesis = Nemesis(world, random.Random(0), 0, log, result)
    marks = {"start": time.time()}
    time.sleep(120)
    marks["down"] = time.time()
    fault(world.info("primary").admin_url, "down")
    nemesis.record("primary down", minutes=minutes)
    time.sleep(minutes * 60)
    heal(world.info("primary").admin_url)
    marks["healed"] = time.time()
    nemesis.record("primary healed")
    time.sleep(120)
    return marks


# --- one mode, start to count ---------------------------------------------------------------------------


def run_mode(work: Path, mode: str, args: argparse.Namespace, seconds: float, rng: random.Random) -> Result:
    result = Result(mode)
    started = time.monotonic()
    say(f"== {mode}: " + (f"the primary down for {args.outage:g} minutes between two healthy ones"
                          if args.outage else f"{seconds / 60:.1f} minutes of nemesis") + f" at {args.rate} keys/s")
    world = World(work / mode, mode, args.rate, {"idle_detach": args.idle_detach, "detach_every": args.detach_every},
                  args.token_lifetime, args.sessions)
    producer = threading.Thread(target=world.produce, daemon=True, name="soak-producer")
    depth = Sampler(world)
    watcher = BacklogWatcher(world)
    try:
        producer.start()
        world.jobs["writer"] = Job(world, "writer", [str(JOBS / "paired_writer.py"), "--conf", str(world.conf_path)])
        if mode == "paired":
            world.jobs["syphon"] = Job(world, "syphon", [str(JOBS / "syphon.py"), "--conf", str(world.conf_path)])
        else:
            world.jobs["reader"] = Job(world, "reader", [__file__, "--reader", str(world.conf_path),
                                                         "--table", str(world.work / "read")])
        depth.start()
        watcher.start()
        marks = None
        if args.outage:
            marks = outage(world, args.outage, work / "faults.jsonl", result)
        else:
            Nemesis(world, rng, seconds, work / "faults.jsonl", result).run()
        world.stop.set()
        producer.join()
        result.produced = world.keys
        say(f"  {mode}: produced {world.keys} keys x {len(QUEUES)} queues in {len(world.files)} files; healing, "
            f"draining")
        world.heal_all()
        drained = drain(world, args.drain_minutes * 60)
        result.drained = drained
        if not drained:
            result.notes.append(f"not drained after {args.drain_minutes:g} minutes")
        for name, job in world.jobs.items():
            result.restarts[name] = job.restarts
            result.failed[name] = len(job.failed)
            result.notes += [f"{name} failed by itself: {line}" for line in job.failed]
            job.halt()
        depth.stop()
        watcher.stop()
        if world.entra:
            result.notes += token_notes(world)
        count(world, result)
        if world.sessions:
            held_batches(world, result, watcher)
            check_order(world, result, watcher)
        if marks is not None:
            result.notes += outage_report(world, marks, depth)
    except Exception as err:
        result.drained = False
        result.notes.append(f"crashed: {type(err).__name__}: {_first_line(err)}")
        traceback.print_exc()
    finally:
        world.stop.set()
        depth.stop()
        watcher.stop()
        world.close()
    result.seconds = time.monotonic() - started
    say(f"== {mode}: lost {sum(result.lost.values())}, duplicated {result.duplicated}"
        + (f", out of order {result.out_of_order}" if world.sessions else "") + f" [{result.seconds:.0f} s]")
    return result


def token_notes(world: World) -> list[str]:
    """How many Entra ID tokens each namespace accepted, and how many of those replaced an expiring one on an open
    connection (renewals), since its emulator's last start."""
    notes = []
    for side in SIDES:
        stats = send_control(world.info(side).admin_url, "stats")
        notes.append(f"{side}: {stats.get('tokens_accepted')} tokens put, {stats.get('tokens_renewed')} of them "
                     "renewals on an open connection (since the emulator's last start)")
    return notes


class Sampler:
    """The backlog's depth (paired) every 5 s, with its time, for the outage report."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.samples: list[tuple[float, int]] = []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="soak-depth")

    def start(self) -> None:
        if self.world.backlog_queues:
            self.thread.start()

    def _run(self) -> None:
        from spark_sb.admin import admin_client

        info = self.world.info("secondary")
        while not self.halt.wait(5.0):
            try:
                admin = admin_client(info.connection_string, admin_endpoint=info.admin_url)
                total = sum(admin.get_queue_runtime_properties(q).total_message_count
                            for q in self.world.backlog_queues)
                self.samples.append((time.time(), total))
            except Exception:
                pass  # the secondary down: no sample

    def stop(self) -> None:
        self.halt.set()


@dataclass
class Parked:
    """A message seen parked in the backlog by the :class:`BacklogWatcher`."""

    queue: str
    sequence_number: int  # in its backlog queue
    first: float  # wall time first and last seen there
    last: float


class BacklogWatcher:
    """``--sessions``: peeks every backlog queue every 2 s and remembers which messages it saw parked, where and
    when, so that an order violation can be traced to the syphon or the sender. A message parked and moved home
    between two peeks is not seen."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.seen: dict[tuple[str, str], Parked] = {}  # (entity, message id) -> where and when
        self.looked: dict[str, list[float]] = collections.defaultdict(list)  # queue -> wall times of its peeks
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="soak-backlog-watcher")

    def start(self) -> None:
        if self.world.sessions and self.world.backlog_queues:
            self.thread.start()

    def _run(self) -> None:
        while not self.halt.wait(2.0):
            for queue in self.world.backlog_queues:
                try:
                    found = _peek_all(self.world.info("secondary").connection_string, queue)
                except Exception:
                    continue  # the secondary down or restarting: nothing seen this time
                now = time.time()
                self.looked[queue].append(now)
                for m in found:
                    entity, _ = messages.parked_session(m)
                    key = (entity or "?", str(m.message_id))
                    if key in self.seen and self.seen[key].queue == queue:
                        self.seen[key].last = now
                    else:
                        self.seen[key] = Parked(queue, int(m.sequence_number or 0), now, now)

    def stop(self) -> None:
        self.halt.set()
        if self.thread.is_alive():
            self.thread.join(60)


def _receive_session(client: ServiceBusClient, queue: str, session: str) -> list[Any]:
    """Every message of ``session`` in ``queue``, received (and deleted) with a session receiver, in order. A
    receiver whose link the namespace detaches (``--detach-every``) is opened again where it stopped: what it
    received is gone from the queue."""
    got: list[Any] = []
    for attempt in range(10):
        try:
            with client.get_queue_receiver(queue, session_id=session, max_wait_time=5,
                                           receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
                empty = 0
                while empty < 2:
                    page = receiver.receive_messages(max_message_count=250, max_wait_time=1)
                    got += page
                    empty = 0 if page else empty + 1
            return got
        except Exception as err:
            say(f"  receiving session {session} of {queue} (attempt {attempt + 1}): {_first_line(err)}; again")
            time.sleep(1.0)
    raise RuntimeError(f"could not receive session {session} of {queue}")


def _seq(message: Any) -> int:
    props = {(k.decode() if isinstance(k, bytes) else k): v for k, v in (message.application_properties or {}).items()}
    return int(props["seq"])


def _active_faults(result: Result, at: float) -> list[str]:
    """The faults active at wall time ``at``: a namespace fault or a killed emulator during its window, a job or
    a worker killed in the 60 s before (a restart takes tens of seconds)."""
    out = []
    start = min((t for t, _, _ in result.events), default=at)
    for t, kind, detail in result.events:
        length = detail.get("seconds", detail.get("down_for"))
        if "minutes" in detail:  # --outage: the primary down until healed
            length = float(detail["minutes"]) * 60
        if length is not None:
            end = t + float(length) + (10 if "down_for" in detail else 0)
        elif kind == "quiet":
            continue
        else:
            end = t + 60
        if t - 2 <= at <= end:
            out.append(f"{kind} at +{t - start:.0f}s" + (f" for {length:g} s" if length is not None else ""))
    return out


def check_order(world: World, result: Result, watcher: BacklogWatcher) -> None:
    """``--sessions``: receive every session of every queue from the primary with a session receiver, and report
    the messages whose sequence number is lower than one received before it in its session (duplicates aside)."""
    start = min((t for t, _, _ in result.events), default=time.time())

    def clock(t: float) -> str:
        return f"+{t - start:.0f}s"

    sessions = sorted({session_of(n, world.sessions)[0] for n in range(1, min(world.keys, world.sessions) + 1)})
    with ServiceBusClient.from_connection_string(world.info("primary").connection_string, retry_total=3) as client:
        for queue in QUEUES:
            violations = 0
            broken = 0
            for session in sessions:
                got = _receive_session(client, queue, session)
                seen: set[int] = set()
                highest: tuple[int, int, Any] | None = None  # (seq, position, message)
                runs: list[list[tuple[int, int, Any, Any]]] = []  # each: (position, seq, message, the higher one)
                for position, m in enumerate(got):
                    seq = _seq(m)
                    if seq in seen:
                        continue  # a duplicate
                    seen.add(seq)
                    if highest is not None and seq < highest[0]:
                        entry = (position, seq, m, highest)
                        if runs and runs[-1][-1][0] == position - 1 and runs[-1][-1][3] is highest:
                            runs[-1].append(entry)
                        else:
                            runs.append([entry])
                    elif highest is None or seq > highest[0]:
                        highest = (seq, position, m)
                n = sum(len(r) for r in runs)
                violations += n
                broken += bool(runs)
                for run in runs:
                    result.notes.append(f"{queue} {session}: " + _describe_run(run, queue, watcher, result, clock))
                # counted as it goes: a check cut short still counts what it found
                result.out_of_order[queue] = violations
                result.sessions_out[queue] = broken
    # whether the run exercised the session path at all: what went to the backlog, what the watcher saw, and the
    # sends decided without a peek (the executors' warnings, in the writer's JVM console)
    parked = sum(int(n) for log in world.work.glob("writer-*.log")
                 for n in re.findall(r"(\d+) -> backlog", log.read_text(errors="replace")))
    unpeeked = sum(log.read_text(errors="replace").count("could not peek backlog queue")
                   for log in world.work.glob("writer-*.jvm.log"))
    result.notes.append(f"sessions: the writer's batches sent {parked} messages to the backlog; the backlog watcher "
                        f"saw {len(watcher.seen)} messages parked; {unpeeked} session sends decided without a peek "
                        "(could not peek backlog queue: sent by what was known)")


def _describe_run(run: list[tuple[int, int, Any, Any]], queue: str, watcher: BacklogWatcher, result: Result,
                  clock: Any) -> str:
    """One run of out-of-order messages: positions, sequence numbers, the message they should have preceded,
    where each was seen, the faults active when the order broke, and whose rule broke."""
    first_pos, _, first, (h_seq, h_pos, higher) = run[0]
    last_pos = run[-1][0]
    seqs = [seq for _, seq, _, _ in run]
    h_at = higher.enqueued_time_utc.timestamp()
    l_at = first.enqueued_time_utc.timestamp()
    late = [watcher.seen.get((queue, str(m.message_id))) for _, _, m, _ in run]
    h_parked = watcher.seen.get((queue, str(higher.message_id)))
    parked = [p for p in late if p is not None]
    if parked and h_parked is None and h_at < max(p.last for p in parked):
        verdict = ("the sender's: the higher one went to the primary while its session had messages parked "
                   f"(seen in {parked[0].queue} until {clock(max(p.last for p in parked))})")
    elif parked and h_parked is not None:
        same = all(p.queue == h_parked.queue for p in parked)
        if same and all(p.sequence_number < h_parked.sequence_number for p in parked):
            verdict = f"the syphon's: all parked in {h_parked.queue} in order and moved home out of order"
        elif not same:
            verdict = (f"the sender's: the session parked in two backlog queues ({h_parked.queue} and "
                       f"{', '.join(sorted({p.queue for p in parked}))})")
        else:
            verdict = f"the sender's: parked out of order in {h_parked.queue}"
    elif parked:
        verdict = (f"unclear: the late ones were last seen parked at {clock(max(p.last for p in parked))}, before "
                   "the higher one reached the primary (the syphon completed them before the primary accepted "
                   "them, or the watcher missed a later parking)")
    else:
        verdict = ("unclear: none of the late ones was seen parked (the watcher peeks every 2 s)"
                   + ("; the higher one was" if h_parked is not None else ""))
    faults = _active_faults(result, h_at)
    return (f"positions {first_pos}-{last_pos} (seq {min(seqs)}-{max(seqs)}, {len(run)} messages"
            f"{', ' + str(len(parked)) + ' seen parked' if parked else ''}) after position {h_pos} (seq {h_seq}, "
            f"{'seen parked in ' + h_parked.queue if h_parked else 'not seen parked'}); on the primary at "
            f"{clock(h_at)} (seq {h_seq}) and {clock(l_at)} (seq {seqs[0]}); faults active at {clock(h_at)}: "
            f"{'; '.join(faults) or 'none'}; {verdict}")


#: the writer's JVM console: a line's time, a task that failed (each attempt: Spark tries a task 4 times), the batch
#: of a lost task, and the error of a session send held in strict mode
_JVM_TIME = re.compile(r"^(\d\d/\d\d/\d\d \d\d:\d\d:\d\d) ")
_TASK_FAILED = re.compile(r" ERROR Executor: Exception in task \S+ in stage \S+ \(TID (\d+)\)")
_TASK_LOST = re.compile(r"\[batchId = (\d+)\] Lost task \S+ in stage \S+ \(TID (\d+)\)")
_HELD = re.compile(r"for entity '([^']+)'.*the backlog can neither say whether session\(s\) (.*?) have messages "
                   r"parked nor take their (\d+) message")
#: the writer's log: a batch sent (its time ends the batch before the next one)
_BATCH_SENT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) INFO spark_sb\.sink: batch \d+: ")
_LONGEST_TRY = 60.0  # seconds: a held task is taken to have started at most this long before it failed


def _held_sends(world: World) -> list[tuple[str, float, float, str, set[str], int]]:
    """Every task attempt of the writer that a session send held (``session_order: strict``: the backlog could
    neither say whether the session had messages parked nor take them), from the writer's JVM console, where
    each failed attempt is logged with its time (a held send fails its task; Spark tries it again, and the batch
    and the writer's run fail after the fourth): ``(where, began, ended, entity, sessions, messages)``. It began
    after the writer's last batch before it, or its task's attempt before it, at most a minute earlier."""
    held = []
    every = {session_of(n, world.sessions)[0] for n in range(1, world.sessions + 1)}
    for jvm in sorted(world.work.glob("writer-*.jvm.log"), key=lambda f: int(f.name.split("-")[1].split(".")[0])):
        log = jvm.with_name(jvm.name.replace(".jvm", ""))
        starts = [datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                  for line in (log.read_text(errors="replace").splitlines() if log.exists() else [])
                  if (m := _BATCH_SENT.match(line))]
        task: tuple[float, str] | None = None
        batch_of: dict[str, str] = {}
        found = []
        for line in jvm.read_text(errors="replace").splitlines():
            if m := _JVM_TIME.match(line):
                at = datetime.datetime.strptime(m[1], "%y/%m/%d %H:%M:%S").timestamp()
                failed = _TASK_FAILED.search(line)
                task = (at, failed[1]) if failed else None
                if failed:
                    starts.append(at)
                if lost := _TASK_LOST.search(line):
                    batch_of[lost[2]] = lost[1]
            elif task is not None and (h := _HELD.search(line)):
                found.append((task, h))
                task = None
        for (at, tid), h in found:
            end = at + 1.0  # the console's times are to the second
            begin = max([t for t in starts if t < at] + [end - _LONGEST_TRY])
            sessions = every if h[2].endswith("...") else set(re.findall(r"'([^']+)'", h[2]))
            held.append((f"{jvm.name} batch {batch_of.get(tid, '?')} (TID {tid})", begin, end, h[1], sessions,
                         int(h[3])))
    return held


def held_batches(world: World, result: Result, watcher: BacklogWatcher) -> None:
    """``--sessions``: each held send (:func:`_held_sends`) with its time, the primary's faults in force while it
    ran (a killed emulator until it was up again), and whether the watcher saw a message of its sessions parked
    then (at any time between the watcher's peek before it was first seen and its peek after it was last seen).
    One held while the primary was healthy and nothing of its sessions was parked counts in ``held_healthy``."""
    start = min((t for t, _, _ in result.events), default=time.time())
    primary = [(t, t + float(d["seconds"]), kind) for t, kind, d in result.events
               if kind.startswith("primary ") and "seconds" in d]
    primary += [(killed, back, "primary emulator killed") for side, killed, back in world.down_spells
                if side == "primary"]

    def parked_between(entity: str, sessions: set[str], begin: float, end: float) -> int:
        n = 0
        for (queue, message_id), p in watcher.seen.items():
            if (queue != entity or not message_id[1:].isdigit()
                    or session_of(int(message_id[1:]), world.sessions)[0] not in sessions):
                continue
            looked = watcher.looked.get(p.queue, [])
            before = max((t for t in looked if t < p.first), default=float("-inf"))
            after = min((t for t in looked if t > p.last), default=float("inf"))
            n += before <= end and after >= begin
        return n

    for where, begin, end, entity, sessions, count in _held_sends(world):
        faults = [f"{kind} +{t - start:.0f}s to +{until - start:.0f}s" for t, until, kind in primary
                  if t <= end and until >= begin]
        parked = parked_between(entity, sessions, begin, end)
        healthy = not faults and not parked
        result.held += 1
        result.held_healthy += healthy
        others = "; ".join(f for f in _active_faults(result, end) if not f.startswith("primary ")) or "none"
        result.notes.append(
            f"held: {where} +{begin - start:.0f}s to +{end - start:.0f}s, {entity} {count} messages of "
            f"{len(sessions)} sessions; primary faults in force: {'; '.join(faults) or 'none'}; messages of those "
            f"sessions seen parked meanwhile: {parked}; other faults active at the failure: {others}"
            + ("; HELD WHILE THE PRIMARY WAS HEALTHY AND NOTHING OF ITS SESSIONS WAS PARKED" if healthy else ""))


def drain(world: World, seconds: float) -> bool:
    """Wait until the writer committed every input file and the backlog (paired) or both namespaces (active)
    are empty."""
    deadline = time.monotonic() + seconds
    wanted = set(world.files)
    last = ""
    while time.monotonic() < deadline:
        written = len(wanted & world.written())
        left = _left(world) if written == len(wanted) else None
        state = f"writer {written}/{len(wanted)} files, left {left}"
        if state != last:
            say(f"  {world.mode}: drain: {state}")
            last = state
        if left == 0:
            return True
        time.sleep(5.0)
    return False


def _left(world: World) -> int:
    """Messages not yet home: in the backlog queues (paired), or in either namespace's queues (active). A ping
    whose cancellation a fault cut is not one: scheduled a year ahead, it expires unread (behaviour.md)."""
    if world.mode == "paired":
        wanted = [("secondary", q) for q in world.backlog_queues]
    else:
        wanted = [(side, q) for side in SIDES for q in QUEUES]
    return sum(not messages.is_ping(m) for side, q in wanted for m in _peek_all(world.info(side).connection_string, q))


def count(world: World, result: Result) -> None:
    """Peek every queue (nothing locked or removed) and account for every key."""
    keys = {f"k{n:07d}" for n in range(1, world.keys + 1)}
    dlq = ServiceBusSubQueue.DEAD_LETTER
    now = datetime.datetime.now(datetime.UTC)
    for queue in QUEUES:
        if world.mode == "paired":
            found = _peek_all(world.info("primary").connection_string, queue)
            ids = [str(m.message_id) for m in found]
            foreign = collections.Counter(m.content_type or "no content type" for m in found
                                          if str(m.message_id) not in keys)
            if foreign:  # a ping whose cancellation a fault cut: scheduled, it expires unread (behaviour.md)
                result.notes.append(f"{queue}: not produced, by content type: {dict(foreign)}")
        else:
            table = world.work / "read" / queue
            ids = ([str(r["message_id"]) for r in _delta_rows(table, ["message_id"])]
                   if (table / "_delta_log").exists() else [])
        got = collections.Counter(i for i in ids if i in keys)
        result.arrived[queue] = sum(got.values())
        result.lost[queue] = len(keys - set(got))
        result.duplicated[queue] = sum(got.values()) - len(got)
        if world.mode == "active" and len(ids) != sum(got.values()):
            result.notes.append(f"{queue}: {len(ids) - sum(got.values())} rows read with ids not produced")
        if result.lost[queue]:
            result.notes.append(f"{queue}: lost e.g. {', '.join(sorted(keys - set(got))[:5])}")
    if world.mode == "paired":
        result.left = _left(world)
        places = [("primary", q) for q in QUEUES] + [("secondary", q) for q in world.backlog_queues]
    else:
        result.left = _left(world)
        places = [(side, q) for side in SIDES for q in QUEUES]
    for side, queue in places:
        for m in _peek_all(world.info(side).connection_string, queue, dlq):
            reason = m.dead_letter_reason or "?"
            if side == "secondary" and world.mode == "paired":
                reason += f" (backlog, for {messages.from_backlog(m, now).entity or '?'})"
            result.dead[f"{side} {queue}: {reason}"] += 1


def outage_report(world: World, marks: dict[str, float], depth: Sampler) -> list[str]:
    """The sink's batch durations healthy / failed over (the writer's log lines ``batch N: ... [S s]``, with
    their timestamps) and the syphon's time to bring the backlog home."""
    line = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) INFO spark_sb\.sink: batch \d+: (\d+) rows: .*\[([\d.]+) s\]$")
    healthy, failed_over = [], []
    for log in sorted(world.work.glob("writer-*.log")):
        for text in log.read_text(errors="replace").splitlines():
            if m := line.match(text):
                at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                if int(m[2]) == 0:
                    continue
                if at < marks["down"] or at > marks["healed"] + 10:
                    healthy.append(float(m[3]))
                elif marks["down"] + 10 < at < marks["healed"]:
                    failed_over.append(float(m[3]))
    notes = []
    if healthy and failed_over:
        h, f = statistics.median(healthy), statistics.median(failed_over)
        notes.append(f"sink batch duration, median: healthy {h:.2f} s ({len(healthy)} batches), failed over "
                     f"{f:.2f} s ({len(failed_over)} batches), ratio {f / h:.2f}; max failed over "
                     f"{max(failed_over):.2f} s")
    peak = max((n for t, n in depth.samples if t <= marks["healed"] + 10), default=0)
    empty = next((t for t, n in depth.samples if t > marks["healed"] and n == 0), None)
    if empty is not None:
        took = empty - marks["healed"]
        notes.append(f"backlog at the heal: {peak} messages; home {took:.0f} s after the heal "
                     f"({peak / took:.0f} msg/s, while the input went on)")
    else:
        notes.append(f"backlog at the heal: {peak} messages; not seen empty")
    return notes


# --- the reader of active mode (a process of its own) ---------------------------------------------------


def reader_main(conf: str, table: str) -> int:
    """``format("servicebus")`` over both namespaces through ``dedupe`` into ``table/<queue>``, one query per
    queue, until killed."""
    sys.path.insert(0, str(JOBS))
    from paired_writer import build_session

    from spark_sb import dedupe
    from spark_sb.source import register

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spark = build_session("spark-sb-soak-reader")
    register(spark)
    queries = []
    for queue in QUEUES:
        stream = (spark.readStream.format("servicebus").option("conf", conf).option("entity", queue)
                  .option("namespaces", "primary,secondary").option("maxMessagesPerTrigger", "500").load())
        queries.append(dedupe(stream, window=DEDUPE_WINDOW).select("message_id", "namespace")
                       .writeStream.format("delta").option("checkpointLocation", f"{table}/_checkpoints/{queue}")
                       .trigger(processingTime="2 seconds").start(f"{table}/{queue}"))
    spark.streams.awaitAnyTermination()
    for query in queries:
        if query.exception() is not None:
            raise query.exception()
    return 0


# --- the report -----------------------------------------------------------------------------------------


def print_notes(results: list[Result]) -> None:
    """Each run's faults by kind, dead-lettered messages by reason and notes, one line each."""
    for r in results:
        print(f"- {r.mode}: faults {json.dumps(dict(r.faults))}")
        for reason, n in sorted(r.dead.items()):
            print(f"- {r.mode}: dead-lettered {n}: {reason}")
        for note in r.notes:
            print(f"- {r.mode}: {note}")


def table(results: list[Result], sessions: int = 0) -> str:
    order = " out of order on / off (sessions) |" if sessions else ""
    lines = ["| mode | produced (keys) | arrived on / off | lost on / off | duplicated on / off |" + order + " left | "
             "dead-lettered | faults (quiet spells apart) | restarts (of which failed, not killed) | minutes |",
             "|" + "---|" * (11 if sessions else 10)]
    for r in results:
        def pair(d: dict[str, int]) -> str:
            return f"{d.get(DEDUP, 0)} / {d.get(PLAIN, 0)}"
        faults = sum(n for kind, n in r.faults.items() if kind != "quiet")
        ordered = (f" {pair(r.out_of_order)} ({pair(r.sessions_out)}) |" if sessions else "")
        lines.append(f"| {r.mode} | {r.produced} | {pair(r.arrived)} | {pair(r.lost)} | {pair(r.duplicated)} |"
                     f"{ordered} {r.left} | {sum(r.dead.values())} | {faults} | "
                     f"{', '.join(f'{k} {v} ({r.failed[k]} failed)' for k, v in r.restarts.items())} | "
                     f"{r.seconds / 60:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of faults, split over the modes")
    parser.add_argument("--seed", type=int, default=None, help="the nemesis's seed (default: a random one)")
    parser.add_argument("--modes", nargs="+", choices=("paired", "active"), default=["paired", "active"])
    parser.add_argument("--rate", type=int, default=10, help="new keys a second (each sent to both queues)")
    parser.add_argument("--drain-minutes", type=float, default=15.0, help="the bound on the drain after the faults")
    parser.add_argument("--idle-detach", type=parse_seconds, default="60s", metavar="DURATION",
                        help="Service Bus's habit: detach links idle this long (Azure: 10m; 0: never)")
    parser.add_argument("--detach-every", type=parse_seconds, default="2m", metavar="DURATION",
                        help="Service Bus's habit: detach every entity link this often (0: never)")
    parser.add_argument("--outage", type=float, default=None, metavar="MINUTES",
                        help="paired mode, the primary down this long instead of the nemesis")
    parser.add_argument("--token-lifetime", type=parse_seconds, default=None, metavar="DURATION",
                        help="reach both namespaces with Entra ID (a managed identity) whose tokens live this long, "
                             "e.g. 60s, so that every job renews its tokens all along (default: SAS connection "
                             "strings, whose tokens the SDK makes for an hour)")
    parser.add_argument("--sessions", type=int, default=0, metavar="N",
                        help="paired mode: session-enabled primary queues, every key in one of N sessions; checks "
                             "each session's order on the primary at the end (default: 0, no sessions)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints, data)")
    parser.add_argument("--reader", metavar="CONF", help=argparse.SUPPRESS)
    parser.add_argument("--table", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:
        return reader_main(args.reader, args.table)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    modes = ["paired"] if args.outage else args.modes
    if args.sessions and modes != ["paired"]:
        parser.error("--sessions is for paired mode (--modes paired): the active reader would consume the sessions")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work = Path(tempfile.mkdtemp(prefix="spark-sb-soak-"))
    say(f"seed {seed}; work folder {work}; Service Bus's habits: idle links detached after "
        f"{args.idle_detach:g} s, every link every {args.detach_every:g} s (0: never)")
    rng = random.Random(seed)
    results = []
    identity = None
    if args.token_lifetime is not None:
        # Entra ID's token endpoint, apart from both namespaces (the nemesis kills their emulators, never it)
        identity = EmulatorProcess.start(data_dir=None, namespaces=[NamespaceOptions("identity")], entra_id=True,
                                         token_lifetime=args.token_lifetime, log_file=work / "identity.log")
        os.environ["IDENTITY_ENDPOINT"] = identity["identity"].identity_endpoint
        os.environ["IDENTITY_HEADER"] = DEFAULT_IDENTITY_HEADER
        say(f"Entra ID: a managed identity with {args.token_lifetime:g}-second tokens from "
            f"{os.environ['IDENTITY_ENDPOINT']}")
    try:
        for mode in modes:
            results.append(run_mode(work, mode, args, args.minutes * 60 / len(modes), rng))
    finally:
        if identity is not None:
            identity.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"seed {seed}; on / off = {DEDUP} (duplicate detection) / {PLAIN}; active mode counts the deduplicated "
          f"read")
    print()
    print(table(results, args.sessions))
    print()
    print_notes(results)
    lost = sum(sum(r.lost.values()) for r in results)
    duplicated = sum(r.duplicated.get(DEDUP, 0) + (r.duplicated.get(PLAIN, 0) if r.mode == "active" else 0)
                     for r in results)
    print()
    out_of_order = sum(sum(r.out_of_order.values()) for r in results)
    held = sum(r.held for r in results)
    held_healthy = sum(r.held_healthy for r in results)
    print(f"seed {seed}: lost {lost}; duplicated with duplicate detection {duplicated}; "
          + (f"out of order (sessions) {out_of_order}; sends held (sessions, strict: failed task attempts) {held}, "
             f"of them while the primary was healthy and nothing of their sessions was parked {held_healthy}; "
             if args.sessions else "")
          + f"drained: {'yes' if all(r.drained for r in results) else 'NO'}")
    return (1 if lost or out_of_order or held_healthy
            else 2 if duplicated or not all(r.drained for r in results) else 0)


if __name__ == "__main__":
    sys.exit(main())
