"""The cluster soak (issue 51): bench/soak.py's world (two emulator processes, a producer of numbered parquet
files, queues with and without duplicate detection, the writer and the syphon restarted whenever they exit) with
the jobs' drivers running against a Spark standalone cluster, and a nemesis of a cluster's faults.

    flock /tmp/spark.lock .venv/bin/python bench/cluster_soak.py [--minutes 30] [--seed S] [--runs plain speculation retries]

The cluster: a master and two workers started from the installed pyspark, each worker on its own loopback address
(127.0.0.2 and 127.0.0.3, so that Spark runs a speculative copy of a task on the other one), two cores and 1 GiB
each; the writer and the syphon each get one executor of one core and 512 MiB on each worker. The runs (``--minutes`` split evenly over them), each on a fresh
world and cluster:

* ``plain``: Spark's defaults (a lost task is tried again on another executor, four attempts in all);
* ``speculation``: ``spark.speculation`` tuned to trigger (after 200 ms, a task 1.1 times slower than the median
  of half its stage's tasks is run again elsewhere; the first copy to finish wins, the other is killed), so that
  two copies of a partition send the same rows at once;
* ``retries``: ``spark.task.maxFailures`` 1: a task lost with its executor fails its stage and the query, the
  driver exits, and the supervisor starts it again on its checkpoint (a driver restart, mid-outage when the
  nemesis has a namespace down);
* ``servicebus``: Spark's defaults, the writer ``writeStream.format("servicebus")`` (Spark calls the data
  source's writer on each partition and its ``commit`` on the driver's side) instead of ``foreachBatch``.

The nemesis draws, seeded, every 2 to 20 s: an executor JVM killed with SIGKILL (a spot instance taken back;
the worker starts another), a whole worker killed with its executors and started again 5 to 30 s later, a Python
worker of an executor killed, the writer's or the syphon's driver killed with SIGKILL (the supervisor submits it
again: a driver restarted from its checkpoint, on a batch it may have half committed), a namespace fault on
either namespace (down, timeout, busy, ack-lost, disabled) for 2 to 60 s, an emulator killed and restarted, a
quiet spell. The nemesis starts once the writer committed a batch and both jobs have their executors. Each fault
is logged with its time (``faults.jsonl``). Then the producer stops, everything is healed and the jobs drain;
every key is counted by message id on both primary queues: lost, duplicated (with duplicate detection,
``soak-dedup``, and without, ``soak-plain``), left in the backlog, dead-lettered; each row's delay from its file
to the primary; and from the drivers' logs (:data:`DRIVER_EVENTS`, :func:`fault_costs`): executors lost, task
attempts lost, speculative copies launched, killed while they ran or finished second, queries failed, the
duration of the writer's batches that lost an executor, and a restarted writer's time to its first batch.

Exit code: 1 when anything was lost, 2 when the queue with duplicate detection holds a duplicate or a run did not
drain, else 0.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pyspark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402
from soak import DEDUP, PLAIN, Job, Nemesis, Result, World, count, drain, say  # noqa: E402

SPARK_HOME = Path(pyspark.__file__).parent
HOSTS = ("127.0.0.2", "127.0.0.3")
RUNS = {
    "plain": {},
    "speculation": {"spark.speculation": "true", "spark.speculation.interval": "200ms",
                    "spark.speculation.multiplier": "1.1", "spark.speculation.quantile": "0.5",
                    "spark.speculation.minTaskRuntime": "500ms"},
    "retries": {"spark.task.maxFailures": "1"},
    "servicebus": {},
}
#: runs whose writer is ``writeStream.format("servicebus")`` (this script, ``--servicebus-writer``), not the
#: paired writer's ``foreachBatch(PairedSink)``
SERVICEBUS_WRITER = {"servicebus"}
#: what the drivers' logs say of the cluster's faults (Spark's own log lines; TaskSetManager's at INFO, see LOG4J)
DRIVER_EVENTS = {
    "executors lost": "Lost executor",
    "task attempts lost": "Lost task",
    "tasks marked speculatable (a copy launched)": "as speculatable",
    "attempts killed while running, another having succeeded": "Killing attempt",
    "copies that finished second (both sent their rows)": "Finish but did not commit due to another attempt",
    "queries failed": "terminated with error",
}


#: the drivers' Spark log: warnings, and the scheduler's lines on tasks (speculative copies, kills) at INFO
LOG4J = """\
rootLogger.level = warn
rootLogger.appenderRef.console.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.tasks.name = org.apache.spark.scheduler.TaskSetManager
logger.tasks.level = info
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A standalone master and two workers (:data:`HOSTS`) in ``work``; workers can be killed and started again."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.master = self._start("master", "127.0.0.1", ["org.apache.spark.deploy.master.Master", "--host",
                                                           "127.0.0.1", "--port", str(self.port), "--webui-port",
                                                           str(_free_port())], "I have been elected leader")
        self.workers: dict[int, subprocess.Popen] = {}
        for n in range(len(HOSTS)):
            self.start_worker(n)

    def _env(self, host: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
        env.update(SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP=host, SPARK_LOG_DIR=str(self.work / "logs"),
                   PYSPARK_PYTHON=sys.executable)
        return env

    def _start(self, name: str, host: str, argv: list[str], ready: str) -> subprocess.Popen:
        log = self.work / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        with log.open("a") as out:
            proc = subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=self._env(host), start_new_session=True)
        deadline = time.monotonic() + 120
        while ready not in log.read_text(errors="replace")[offset:]:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)
        return proc

    def worker_dir(self, n: int) -> Path:
        return self.work / f"worker-{n}"

    def start_worker(self, n: int) -> None:
        self.workers[n] = self._start(
            f"worker-{n}", HOSTS[n], ["org.apache.spark.deploy.worker.Worker", self.url, "--host", HOSTS[n],
                                      "--cores", "2", "--memory", "1g", "--webui-port", str(_free_port()),
                                      "--work-dir", str(self.worker_dir(n))], "Successfully registered with master")

    def executors(self, n: int | None = None) -> list[int]:
        """Executor JVMs (of every worker, or of worker ``n``)."""
        dirs = [str(self.worker_dir(i)) for i in (range(len(HOSTS)) if n is None else [n])]
        table = soak._proc_table()
        found = []
        for pid, (_, cmd, _) in table.items():
            if "CoarseGrainedExecutorBackend" not in cmd:
                continue
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            if any(cwd.startswith(d) for d in dirs):
                found.append(pid)
        return sorted(found)

    def python_workers(self) -> list[int]:
        """Python workers (forks of ``pyspark.daemon``) under an executor JVM."""
        executors = set(self.executors())
        table = soak._proc_table()

        def under_executor(pid: int) -> bool:
            while pid > 1 and pid in table:
                if pid in executors:
                    return True
                pid = table[pid][0]
            return False

        return sorted(pid for pid, (ppid, cmd, _) in table.items()
                      if "pyspark.daemon" in cmd and "pyspark.daemon" in table.get(ppid, (0, "", 0))[1]
                      and under_executor(pid))

    def kill_worker(self, n: int) -> list[int]:
        """SIGKILL worker ``n`` and its executors (a machine lost); returns the executors' pids."""
        executors = self.executors(n)
        proc = self.workers.pop(n, None)
        if proc is not None:
            soak._kill_group(proc)
        for pid in executors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return executors

    def stop(self) -> None:
        for proc in [*self.workers.values(), self.master]:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in [*self.workers.values(), self.master]:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                soak._kill_group(proc)
        for pid in self.executors():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ClusterNemesis(Nemesis):
    """:class:`soak.Nemesis` with a cluster's faults: executors, workers, Python workers and drivers killed."""

    KINDS = (["namespace"] * 6 + ["executor-killed"] * 6 + ["worker-lost", "python-worker-killed",
             "driver-killed", "emulator-killed"] + ["quiet"])

    def __init__(self, world: World, cluster: Cluster, rng: random.Random, seconds: float, log: Path,
                 result: Result) -> None:
        super().__init__(world, rng, seconds, log, result)
        self.cluster = cluster

    def _kill_one(self, kind: str, pids: list[int], pick: float, none: str) -> None:
        """SIGKILL the process ``pick`` chooses among ``pids`` (or record the fault skipped, saying ``none``)."""
        if not pids:
            self.record(kind, skipped=none)
            return
        pid = pids[int(pick * len(pids))]
        os.kill(pid, signal.SIGKILL)
        self.record(kind, pid=pid, of=len(pids))

    def _one(self, kind: str, side: str, what: str, length: float, pause: float, pick: float) -> None:
        cluster = self.cluster
        if kind == "executor-killed":
            self._kill_one(kind, cluster.executors(), pick, "no executor running")
        elif kind == "worker-lost":
            n = int(pick * len(HOSTS))
            if n not in cluster.workers:
                self.record(kind, skipped=f"worker {n} already down")
                return
            executors = cluster.kill_worker(n)
            back = round(5 + pause * 3, 1)  # 8 to 29 s
            self.record(kind, worker=n, executors=executors, back_after=back)

            def restart() -> None:
                time.sleep(back)
                try:
                    cluster.start_worker(n)
                    self.record("worker restarted", worker=n)
                except Exception as err:
                    say(f"  worker {n} did not start again: {soak._first_line(err)}")

            threading.Thread(target=restart, daemon=True, name=f"restart-worker-{n}").start()
        elif kind == "python-worker-killed":
            self._kill_one(kind, cluster.python_workers(), pick, "no Python worker running")
        elif kind == "driver-killed":
            job = self.world.jobs["writer" if pick < 0.6 else "syphon"]
            done = job.kill()
            self.record(f"{job.name} driver killed", **({} if done else {"skipped": "not running"}))
        else:
            super()._one(kind, side, what, length, pause, pick)


def warm_up(world: World, cluster: Cluster, seconds: float) -> None:
    """Wait (at most ``seconds``) until the writer committed a batch and both jobs have their executors: the
    drivers up, so that the nemesis's first faults meet running tasks (two drivers start in a minute or more on
    two loaded cores)."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if world.written() and len(cluster.executors()) >= 2 * len(HOSTS):
            say(f"  the writer committed a batch and both jobs have their executors after "
                f"{time.monotonic() - started:.0f} s: the nemesis starts")
            return
        time.sleep(1.0)
    say(f"  the jobs were not both up after {seconds:.0f} s: the nemesis starts anyway")


def delays(world: World) -> str:
    """How long the rows took to reach the primary's queue with duplicate detection, from their file's writing to
    their (first) enqueueing there (home from the backlog for a parked row): median, 99th percentile, maximum."""
    written = {}
    for message in soak._peek_all(world.info("primary").connection_string, DEDUP):
        key = str(message.message_id)
        if not key.startswith("k") or not key[1:].isdigit():
            continue
        file = (int(key[1:]) - 1) // world.rate
        if file < len(world.file_times) and key not in written:
            written[key] = message.enqueued_time_utc.timestamp() - world.file_times[file]
    if not written:
        return "row delay: no row found"
    ordered = sorted(written.values())
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return (f"row delay (file written -> in {DEDUP} on the primary), {len(ordered)} rows: median {at(0.5):.1f} s, "
            f"p99 {at(0.99):.1f} s, max {ordered[-1]:.1f} s")


_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)"
_BATCH = re.compile(_STAMP + r" INFO spark_sb\.sink: batch \d+: .*\[([\d.]+) s\]$")
_STARTING = re.compile(_STAMP + r" INFO spark_sb\.jobs: starting Spark")
_LOST = re.compile(r"^(\d\d/\d\d/\d\d \d\d:\d\d:\d\d) ERROR TaskSchedulerImpl: Lost executor")


def _at(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def fault_costs(world: World) -> list[str]:
    """What a lost executor and a restarted driver cost the paired writer, from its logs: the duration of the
    sink's batches that had an executor lost while they ran (Spark's ``Lost executor`` line inside the batch's
    span) beside the others', and for each driver run after the first, the time from its start to its first
    batch (the JVM's start, the checkpoint's recovery; a run killed before its first batch is counted apart)."""
    spans, lost, restarts, killed_early = [], [], [], 0
    for log in sorted(world.work.glob("writer-[0-9]*.log")):
        if log.name.endswith(".jvm.log"):
            continue
        text = log.read_text(errors="replace").splitlines()
        batches = [(_at(m[1]), float(m[2])) for line in text if (m := _BATCH.match(line))]
        spans += [(end - seconds, end, seconds) for end, seconds in batches]
        jvm = log.with_name(log.name.replace(".log", ".jvm.log"))
        if jvm.exists():
            lost += [datetime.datetime.strptime(m[1], "%y/%m/%d %H:%M:%S").timestamp()
                     for line in jvm.read_text(errors="replace").splitlines() if (m := _LOST.match(line))]
        started = next((_at(m[1]) for line in text if (m := _STARTING.match(line))), None)
        if log.name != "writer-1.log" and started is not None:
            if batches:
                restarts.append(batches[0][0] - batches[0][1] - started)
            else:
                killed_early += 1
    notes = []
    hit = [seconds for begin, end, seconds in spans if any(begin - 1 <= t <= end + 1 for t in lost)]
    rest = [seconds for begin, end, seconds in spans if not any(begin - 1 <= t <= end + 1 for t in lost)]
    if hit and rest:
        notes.append(f"writer batches with an executor lost while they ran: {len(hit)}, median "
                     f"{statistics.median(hit):.1f} s, max {max(hit):.1f} s (the others: {len(rest)}, median "
                     f"{statistics.median(rest):.1f} s)")
    if restarts:
        notes.append(f"writer driver restarts: {len(restarts)} reached a batch, start to first batch median "
                     f"{statistics.median(restarts):.0f} s, max {max(restarts):.0f} s; {killed_early} killed "
                     "before their first batch")
    return notes


def driver_events(world: World) -> dict[str, int]:
    """Counts of :data:`DRIVER_EVENTS` in every run of every job's driver log."""
    counts: collections.Counter[str] = collections.Counter()
    for log in world.work.glob("*-[0-9]*.log"):
        text = log.read_text(errors="replace")
        for what, needle in DRIVER_EVENTS.items():
            counts[f"{log.name.split('-')[0]}: {what}"] += text.count(needle)
    return dict(sorted((k, v) for k, v in counts.items() if v))


def run(work: Path, name: str, args: argparse.Namespace, seconds: float, rng: random.Random) -> Result:
    result = Result(name)
    started = time.monotonic()
    say(f"== {name}: {seconds / 60:.1f} minutes of cluster nemesis at {args.rate} keys/s "
        f"({', '.join(f'{k}={v}' for k, v in RUNS[name].items()) or 'Spark defaults'})")
    world = World(work / name, "paired", args.rate, {"idle_detach": 0, "detach_every": 0})
    (world.work / "cluster").mkdir()
    cluster = Cluster(world.work / "cluster")
    log4j = world.work / "cluster" / "log4j2.properties"
    log4j.write_text(LOG4J)
    # each job one executor of one core on each worker (the writer and the syphon share the workers)
    settings = {"spark.pyspark.python": sys.executable, "spark.executor.memory": "512m",
                "spark.executor.cores": "1", "spark.cores.max": "2",
                "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{log4j}",
                "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2",
                "spark.sql.streaming.schemaInference": "true", "spark.sql.streaming.stopTimeout": "30s",
                **RUNS[name]}
    env = {"SPARK_MASTER": cluster.url, "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_SUBMIT_ARGS": " ".join(f"--conf {k}={v}" for k, v in settings.items()) + " pyspark-shell"}
    producer = threading.Thread(target=world.produce, daemon=True, name="soak-producer")
    try:
        producer.start()
        writer = ([__file__, "--servicebus-writer", str(world.conf_path)] if name in SERVICEBUS_WRITER
                  else [str(soak.JOBS / "paired_writer.py"), "--conf", str(world.conf_path)])
        world.jobs["writer"] = Job(world, "writer", writer, env)
        world.jobs["syphon"] = Job(world, "syphon", [str(soak.JOBS / "syphon.py"), "--conf", str(world.conf_path)],
                                   env)
        warm_up(world, cluster, 300)
        ClusterNemesis(world, cluster, rng, seconds, work / "faults.jsonl", result).run()
        world.stop.set()
        producer.join()
        result.produced = world.keys
        say(f"  {name}: produced {world.keys} keys x 2 queues in {len(world.files)} files; healing, draining")
        for n in range(len(HOSTS)):
            if n not in cluster.workers:
                cluster.start_worker(n)
        world.heal_all()
        result.drained = drain(world, args.drain_minutes * 60)
        if not result.drained:
            result.notes.append(f"not drained after {args.drain_minutes:g} minutes")
        for job_name, job in world.jobs.items():
            result.restarts[job_name] = job.restarts
            result.failed[job_name] = len(job.failed)
            result.notes += [f"{job_name} failed by itself: {line}" for line in job.failed]
            job.halt()
        count(world, result)
        result.notes += [f"{what}: {n}" for what, n in driver_events(world).items()]
        result.notes.append(delays(world))
        result.notes += fault_costs(world)
    except Exception as err:
        result.drained = False
        result.notes.append(f"crashed: {type(err).__name__}: {soak._first_line(err)}")
        traceback.print_exc()
    finally:
        world.stop.set()
        world.close()
        cluster.stop()
    result.seconds = time.monotonic() - started
    say(f"== {name}: lost {sum(result.lost.values())}, duplicated {result.duplicated} [{result.seconds:.0f} s]")
    return result


def servicebus_writer_main(conf: str) -> int:
    """The writer of the ``servicebus`` run: ``sink.source``'s files -> ``writeStream.format("servicebus")``
    with ``sink.checkpoint_location`` and ``sink.trigger``, until killed or failed."""
    import logging

    from spark_sb.config import load_config
    from spark_sb.jobs import build_session, read_source
    from spark_sb.source import register

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(conf)
    spark = build_session("spark-sb-soak-servicebus-writer")
    register(spark)
    query = (read_source(spark, config).writeStream.format("servicebus").option("conf", conf)
             .option("checkpointLocation", str(config.sink.checkpoint_location))
             .trigger(processingTime=f"{config.sink.trigger.total_seconds()} seconds").start())
    query.awaitTermination()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of faults, split over the runs")
    parser.add_argument("--seed", type=int, default=None, help="the nemesis's seed (default: a random one)")
    parser.add_argument("--runs", nargs="+", choices=tuple(RUNS), default=list(RUNS))
    parser.add_argument("--rate", type=int, default=10, help="new keys a second (each sent to both queues)")
    parser.add_argument("--drain-minutes", type=float, default=15.0, help="the bound on the drain after the faults")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, checkpoints, data)")
    parser.add_argument("--servicebus-writer", metavar="CONF", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.servicebus_writer:
        return servicebus_writer_main(args.servicebus_writer)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="spark-sb-cluster-soak-"))
    say(f"seed {seed}; work folder {work}")
    rng = random.Random(seed)
    results = []
    try:
        for name in args.runs:
            results.append(run(work, name, args, args.minutes * 60 / len(args.runs), rng))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"seed {seed}; on / off = {DEDUP} (duplicate detection) / {PLAIN}")
    print()
    print(soak.table(results))
    print()
    soak.print_notes(results)
    lost = sum(sum(r.lost.values()) for r in results)
    duplicated = sum(r.duplicated.get(DEDUP, 0) for r in results)
    drained = all(r.drained for r in results)
    print(f"\nseed {seed}: lost {lost}; duplicated with duplicate detection {duplicated}; duplicated without "
          f"{sum(r.duplicated.get(PLAIN, 0) for r in results)}; drained: {'yes' if drained else 'NO'}")
    return 1 if lost else 2 if duplicated or not drained else 0


if __name__ == "__main__":
    sys.exit(main())
