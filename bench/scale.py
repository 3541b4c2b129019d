"""How cost grows, one run, one emulator pair (a child process, messages in memory), one local Spark session.

1. the sink's rows/s (``PairedSink`` called on one batch) for 1, 2 and 4 partitions x 1 KiB and 64 KiB bodies,
   each over the raw SDK sending the same messages from as many plain Python processes (bench/sink.py's
   ``raw_sdk``);
2. the syphon job's messages/s (``jobs/syphon.py``, bench/syphon.py's ``spark_job``: steady state from the end
   of the first batch) for 1, 2 and 4 backlog queues, 1 KiB messages spread evenly;
3. the peak memory (ru_maxrss) of the Python workers while the sink sends 100,000 and then 1,000,000 rows of
   ~100-byte bodies (bench/sink.py's default body): ru_maxrss only grows, so equal peaks mean flat memory;
4. where the limit is: the CPU time of the emulator process (one Python process: its threads share one GIL,
   so 100% of one core is its ceiling), of Spark's JVM, of the Python workers (the sink's code and the SDK)
   and of this driver (and the raw SDK processes), over the wall time of each cell, from /proc.

The session is local[4] (4 task slots, so that 4 partitions run at once) on a 2-core machine: 1- and
2-partition cells simply use fewer slots. Each cell sends to queues of its own, deleted after the cell, so that
the emulator never holds more than one cell's messages. The memory section runs first, on fresh workers,
before the 64 KiB cells inflate the workers' peaks.

    flock /tmp/spark.lock .venv/bin/python bench/scale.py [--scale 1.0]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.append(str(BENCH.parent / "jobs"))
import sink as sink_bench  # noqa: E402
from paired_send import _free_ports  # noqa: E402

from spark_sb.admin import admin_client  # noqa: E402
from spark_sb.emulator import EmulatorProcess  # noqa: E402
from spark_sb.paired import PairedSender  # noqa: E402

KIB = 1024
SIZES = (1 * KIB, 64 * KIB)
PARTITIONS = (1, 2, 4)
#: rows per sink cell by body size (about 5-20 s each at the rates of this machine)
CELL_ROWS = {1 * KIB: 40_000, 64 * KIB: 12_000}
MEMORY_ROWS = (100_000, 1_000_000)
QUEUE_COUNTS = (1, 2, 4)
SYPHON_MESSAGES = 12_000  # three batches of 4,000: the first is not timed
PER_TRIGGER = 4_000
_RAW_WORKER = sink_bench.raw_worker  # the original, also in the raw SDK processes (spawned: they import anew)


def _load(name: str, path: Path):
    """bench/syphon.py under another name: its ``spark_job`` imports ``syphon``, meaning jobs/syphon.py."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


syphon_bench = _load("bench_syphon", BENCH / "syphon.py")


def _by_value(module) -> None:
    """Ship ``module``'s functions (bench/sink.py's ``_peak_rss``) to the Python workers by value: bench/ is
    not on their path."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(module)


# --- CPU time from /proc -----------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, command, CPU seconds of the process itself) or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[1]), comm, (int(rest[11]) + int(rest[12])) / TICK


def our_processes(emulator_pid: int) -> dict[int, tuple[str, float]]:
    """{pid: (group, CPU seconds)} of this driver and its descendants: the emulator, Spark's JVM, the Python
    workers (the JVM's descendants) and the driver (with the raw SDK processes)."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p))) is not None}
    me, out = os.getpid(), {}
    for pid, (_, comm, seconds) in stats.items():
        chain, parent = [], pid
        while parent in stats and parent not in (me, 0, 1):
            chain.append(parent)
            parent = stats[parent][0]
        if pid != me and parent != me:
            continue  # not ours
        if emulator_pid in chain:
            group = "emulator"
        elif comm == "java":
            group = "jvm"
        elif any(stats[c][1] == "java" for c in chain[1:]):
            group = "workers"
        else:
            group = "driver"
        out[pid] = group, seconds
    return out


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far (every user: the machine is shared)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK  # all but idle and iowait


GROUPS = ("emulator", "jvm", "workers", "driver")


class Meter:
    """CPU per group (in cores) over the wall time of a ``with`` block. A sampler thread reads every process
    every 0.5 s and keeps each one's last value, so that a process that ends (a Python worker Spark retires)
    keeps its CPU; it also keeps the emulator's busiest 2 s."""

    def __init__(self, emulator_pid: int) -> None:
        self.emulator_pid = emulator_pid
        self.cores: dict[str, float] = {}
        self.wall = 0.0
        self.emulator_peak = 0.0
        self._done = threading.Event()

    def _used(self, group: str) -> float:
        return sum(seconds - self._first.get(pid, (group, 0.0))[1]
                   for pid, (g, seconds) in self._last.items() if g == group)

    def _sample(self) -> None:
        samples = [(time.perf_counter(), 0.0)]
        while not self._done.wait(0.5):
            self._last.update(our_processes(self.emulator_pid))
            samples.append((time.perf_counter(), self._used("emulator")))
            start = next((s for s in reversed(samples) if samples[-1][0] - s[0] >= 2.0), None)
            if start is not None:
                self.emulator_peak = max(self.emulator_peak, (samples[-1][1] - start[1]) / (samples[-1][0] - start[0]))

    def __enter__(self) -> Meter:
        self._first = our_processes(self.emulator_pid)
        self._last = dict(self._first)
        self._busy, self._started = machine_busy(), time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._last.update(our_processes(self.emulator_pid))
        self.wall = time.perf_counter() - self._started
        self.cores = {group: self._used(group) / self.wall for group in GROUPS}
        self.cores["machine"] = (machine_busy() - self._busy) / self.wall

    def describe(self) -> str:
        c = self.cores
        return (f"emulator {c['emulator']:.0%} of a core, JVM {c['jvm']:.2f}, workers {c['workers']:.2f}, "
                f"driver {c['driver']:.2f}, machine {c['machine']:.2f} of 2 cores")


# --- the sink ------------------------------------------------------------------------------------------------

def _sized_raw_worker(pad: str, *args: object) -> None:
    """bench/sink.py's raw SDK worker with bodies of another size (runs in a spawned process)."""
    sink_bench.PAD = pad
    _RAW_WORKER(*args)


def pad_for(size: int) -> str:
    return "x" * (size - 16)  # "row <i> " + pad: about ``size`` bytes


def raw_rate(conn: str, queue: str, rows: int, partitions: int, size: int) -> float:
    sink_bench.raw_worker = functools.partial(_sized_raw_worker, pad_for(size))
    try:
        return sink_bench.raw_sdk(conn, queue, rows, partitions)
    finally:
        sink_bench.raw_worker = _RAW_WORKER


def frame(spark, rows: int, partitions: int, pad: str, entity: str):
    from pyspark.sql import functions as F

    ids = spark.range(rows, numPartitions=partitions)
    return ids.select(F.concat(F.lit("row "), F.col("id").cast("string"), F.lit(" " + pad)).alias("body"),
                      F.col("id").cast("string").alias("key"), F.lit(entity).alias("entity"))


class Bench:
    def __init__(self, spark, emu: EmulatorProcess, work: Path) -> None:
        from spark_sb.sink import PairedSink

        self.spark, self.emu, self.work = spark, emu, work
        p, s = emu["primary"], emu["secondary"]
        self.primary, self.secondary = p, s
        self.config = {
            "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
            "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
            "send_availability": {"backlog_queue_count": 1},
            "sink": {"entity": "warm", "chunk_size": sink_bench.CHUNK, "key_column": "key"},
        }
        self.sink = PairedSink.from_config(self.config)  # one configuration: each worker pairs once
        self.admin = admin_client(p.connection_string, admin_endpoint=p.admin_url)

    def meter(self) -> Meter:
        return Meter(self.emu.proc.pid)

    def warm(self, partitions: int) -> None:
        """Start (or keep alive: Spark ends a worker idle for a minute) the workers and pair their senders."""
        self.sink(frame(self.spark, partitions * 10, partitions, "", "warm"), 0)

    def send(self, rows: int, partitions: int, pad: str, queue: str) -> tuple[float, Meter]:
        self.admin.create_queue(queue)
        self.warm(partitions)
        with self.meter() as m:
            summary = self.sink(frame(self.spark, rows, partitions, pad, queue), 1)
        assert summary.primary == rows, summary.describe()
        self.drop(queue)
        return rows / m.wall, m

    def drop(self, *queues: str) -> None:
        for queue in queues:
            self.admin.delete_queue(queue)

    def memory(self, counts: tuple[int, ...], partitions: int = 2) -> list[tuple[str, dict[int, int], Meter | None]]:
        self.warm(partitions)
        peaks = [("after warm-up", sink_bench.worker_peaks(self.spark, partitions), None)]
        for rows in counts:
            print(f"memory: {rows:,} rows of ~{len(sink_bench.body(rows))} bytes, {partitions} partitions ...",
                  flush=True)
            rate, m = self.send(rows, partitions, sink_bench.PAD, "mem")
            peaks.append((f"after {rows:,} rows ({rate:,.0f} rows/s)", sink_bench.worker_peaks(self.spark, partitions), m))
        return peaks

    def cell(self, size: int, partitions: int, rows: int) -> dict:
        raw_queue, sink_queue = f"raw-{size // KIB}k-{partitions}", f"sink-{size // KIB}k-{partitions}"
        self.admin.create_queue(raw_queue)
        with self.meter() as raw_meter:
            raw = raw_rate(self.primary.connection_string, raw_queue, rows, partitions, size)
        self.drop(raw_queue)
        rate, sink_meter = self.send(rows, partitions, pad_for(size), sink_queue)
        # the raw call's wall time includes starting its processes: count the emulator's CPU over its send time
        raw_emulator = raw_meter.cores["emulator"] * raw_meter.wall / (rows / raw)
        return {"size": size, "partitions": partitions, "rows": rows, "sink": rate, "raw": raw,
                "raw emulator": raw_emulator, "meter": sink_meter}

    def syphon(self, queues: int, messages: int) -> tuple[float, dict, Meter]:
        entity = f"job{queues}"
        self.admin.create_queue(entity)
        config = {**self.config, "send_availability": {"backlog_queue_count": queues},
                  "syphon": {"receive_batch": 100, "retry_interval": "1s",
                             "checkpoint_location": str(self.work / f"checkpoint{queues}"),
                             "ledger": str(self.work / f"ledger{queues}")}}
        with PairedSender.from_config(config) as sender:
            sender.pair()
            backlog = list(sender.backlog_queues)
        syphon_bench.park_evenly(self.secondary.connection_string, backlog, entity, messages, entity)
        with self.meter() as m:
            rate, steps = syphon_bench.spark_job(config, messages, PER_TRIGGER)
        self.drop(entity)
        return rate, steps, m


# --- the report ------------------------------------------------------------------------------------------------

def limit(cores: dict[str, float], emulator: float | None = None, ratio: float | None = None) -> str:
    """Name the limit from the CPU of a cell (``emulator`` overrides the emulator's share: a peak)."""
    emulator = cores["emulator"] if emulator is None else emulator
    if emulator >= 0.85:
        return f"the emulator (one process, one GIL: {emulator:.0%} of a core)"
    ours = {"the Python workers (the SDK and our code)": cores["workers"], "Spark's JVM": cores["jvm"],
            "the SDK in the driver/raw processes": cores["driver"]}
    top = max(ours, key=ours.__getitem__)
    others = max(0.0, cores["machine"] - sum(ours.values()) - cores["emulator"])
    detail = (f"emulator {emulator:.0%} of a core, {top} {ours[top]:.2f} cores, machine {cores['machine']:.2f} "
              f"of 2 cores of which {others:.2f} other users'")
    if cores["machine"] >= 1.8:
        return f"CPU: the 2 cores are saturated, the biggest share of ours is {top} ({detail})"
    if ratio is not None and ratio < 0.8:
        return f"Spark's overhead (sink/raw {ratio:.2f}; {detail})"
    return f"{top}, single-threaded per process, not the emulator ({detail})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every row and message count")
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from paired_writer import build_session

    count = lambda n: max(1_000, int(n * args.scale))  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    (work / "entities.yaml").write_text("queues:\n  - name: warm\n")
    began = time.perf_counter()
    with EmulatorProcess.start(data_dir=None, namespaces=_free_ports(), entities=work / "entities.yaml") as emu:
        spark = build_session("spark-sb-bench-scale", master="local[4]")
        spark.sparkContext.setLogLevel("ERROR")
        spark.stop = lambda: None  # bench/syphon.py's spark_job stops its session: this one is stopped last
        _by_value(sink_bench)
        bench = Bench(spark, emu, work)
        memory_rows = tuple(count(n) for n in MEMORY_ROWS)
        peaks, cells, runs = [], [], []
        try:
            peaks = bench.memory(memory_rows)
            for size in SIZES:
                for partitions in PARTITIONS:
                    rows = count(CELL_ROWS[size])
                    print(f"sink: {rows:,} rows of {size // KIB} KiB, {partitions} partitions ...", flush=True)
                    cells.append(bench.cell(size, partitions, rows))
            for queues in QUEUE_COUNTS:
                messages = count(SYPHON_MESSAGES)
                print(f"syphon job: {messages:,} messages over {queues} backlog queues ...", flush=True)
                runs.append((queues, messages, *bench.syphon(queues, messages)))
        except Exception:  # report what was measured, then the failure
            traceback.print_exc()
        finally:
            del spark.stop
            spark.stop()
    report(peaks, memory_rows, cells, runs, time.perf_counter() - began)
    return 0


def report(peaks: list, memory_rows: tuple[int, ...], cells: list[dict], runs: list, seconds: float) -> None:
    if cells:
        report_sink(cells)
    if runs:
        report_syphon(runs)
    if len(peaks) == 3:
        report_memory(peaks, memory_rows)
    print(f"\nthe whole run: {seconds:.0f} s")


def report_sink(cells: list[dict]) -> None:
    print()
    print("1. the sink, one batch (rows/s; raw SDK: as many plain processes as partitions)")
    print(f"{'body':>6} {'parts':>5} {'rows':>7} {'sink':>8} {'raw SDK':>8} {'ratio':>5}  CPU over the sink's send")
    for c in cells:
        print(f"{c['size'] // KIB:>4}Ki {c['partitions']:>5} {c['rows']:>7,} {c['sink']:>8,.0f} {c['raw']:>8,.0f} "
              f"{c['sink'] / c['raw']:>5.2f}  {c['meter'].describe()} (raw SDK: emulator {c['raw emulator']:.0%})")
    worst = max(cells, key=lambda c: c["meter"].cores["emulator"])
    for size in SIZES:
        mine = [c for c in cells if c["size"] == size]
        top = max(mine, key=lambda c: c["sink"])
        where = limit(top["meter"].cores, ratio=top["sink"] / top["raw"])
        print(f"limit, sink {size // KIB} KiB: {where} "
              f"at the best cell ({top['partitions']} partitions, {top['sink']:,.0f} rows/s, "
              f"{top['sink'] * size / 2**20:,.1f} MiB/s); busiest emulator: {worst['meter'].cores['emulator']:.0%}")


def report_syphon(runs: list) -> None:
    print()
    print(f"2. the syphon job, 1 KiB messages, maxMessagesPerTrigger {PER_TRIGGER} (steady state after batch 1)")
    for queues, messages, rate, steps, m in runs:
        per_batch = ", ".join(f"{k.split()[-1]} {v:.2f}s" for k, v in steps.items()
                              if k in ("spark latestOffset", "spark addBatch", "spark triggerExecution"))
        print(f"  {queues} backlog queue(s), {messages:,} messages: {rate:,.0f} messages/s; per batch {per_batch}; "
              f"over the run: {m.describe()}, emulator's busiest 2 s {m.emulator_peak:.0%}")
    best = max(runs, key=lambda r: r[2])
    print(f"limit, syphon job: {limit(best[4].cores, emulator=best[4].emulator_peak)} "
          f"(best {best[2]:,.0f} messages/s with {best[0]} queue(s); rate by queues: "
          f"{', '.join(f'{r[0]}: {r[2]:,.0f}' for r in runs)})")


def report_memory(peaks: list, memory_rows: tuple[int, ...]) -> None:
    print()
    print("3. peak memory of the Python workers (ru_maxrss, MiB; it only grows)")
    for label, by_pid, m in peaks:
        print(f"  {label:40s} max {max(by_pid.values()) / 1024:6.0f}  "
              f"({', '.join(f'{pid}: {kib / 1024:.0f}' for pid, kib in sorted(by_pid.items()))})"
              + (f"; {m.describe()}" if m else ""))
    small, large = (max(p[1].values()) / 1024 for p in peaks[1:3])
    print(f"memory: {'flat' if large <= small * 1.1 + 10 else 'GROWING'} ({small:.0f} MiB after "
          f"{memory_rows[0]:,} rows, {large:.0f} MiB after {memory_rows[1]:,})")
    print(f"limit, memory section: {limit(peaks[2][2].cores)}")


if __name__ == "__main__":
    sys.exit(main())
