"""Late messages on a loaded machine (issue 21's straggler): the ``servicebus`` source reads N messages, in R
runs, while B busy loops take the CPU beside it.

A run has a late message when some batch comes more than ``--late`` seconds after the batch before it, or the
source has not read every message by the deadline. The straggler was one or two messages a lock's duration
(60 s) late, in a batch of their own: two of the SDK's threads listened on a receiver's connection at once and
settled each other's deliveries (docs/sizing.md, "A straggler, found and fixed"). Before the fix it came in 5 of 17 runs of 28,000
messages beside two busy loops (an ad-hoc script: a new Spark session and emulator per run, ``yes`` as the
load); a batch of 4,000 takes a few seconds, so a 30 s gap is nothing else. This tool is less sensitive than
that script: with the fix taken out it found 0 late runs of 6 (one run had a 22 s gap over 9 batches, not
examined), so a 0 here is weak evidence; the fix's proof is tests/bus/test_namespace.py.

    .venv/bin/python bench/late.py [--runs 4] [--messages 28000] [--busy 2] [--late 30]

Prints one line per run (batches, the largest gap between two batches, the sequence numbers of a small batch
after a gap) and ends with ``runs with a late message: K of R``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from replication import fill

from spark_sb.emulator import EmulatorProcess, NamespaceOptions


def read_all(spark: Any, config: dict, queue: str, n: int, deadline: float) -> list[tuple[float, list[int]]]:
    """Each batch's arrival time and sequence numbers, until ``n`` messages are read or ``deadline`` seconds."""
    from spark_sb.source import config_options

    batches: list[tuple[float, list[int]]] = []

    def record(df: Any, batch_id: int) -> None:
        numbers = sorted(row[0] for row in df.select("sequence_number").collect())
        if numbers:
            batches.append((time.perf_counter(), numbers))

    stream = (spark.readStream.format("servicebus").options(**config_options(config)).option("entity", queue)
              .option("maxMessagesPerTrigger", "4000").option("receiveTimeout", "0.5").load())
    query = stream.writeStream.foreachBatch(record).option(
        "checkpointLocation", tempfile.mkdtemp(prefix="bench-late-")).start()
    started = time.perf_counter()
    try:
        while (sum(len(b) for _, b in batches) < n and query.isActive
               and time.perf_counter() - started < deadline):
            query.awaitTermination(0.2)
    finally:
        query.stop()
    return batches


def describe(batches: list[tuple[float, list[int]]], n: int, late: float) -> tuple[bool, str]:
    """Whether the run had a late message, and its line."""
    read = [x for _, b in batches for x in b]
    gaps = [(batches[i][0] - batches[i - 1][0], batches[i][1]) for i in range(1, len(batches))]
    widest, after = max(gaps, default=(0.0, []))
    missing = n - len(set(read))
    is_late = widest > late or missing > 0
    line = (f"{len(batches)} batches, {len(read)} rows ({len(set(read))} distinct), "
            f"widest gap {widest:.1f} s")
    if widest > late:
        line += f" before a batch of {len(after)}" + (f": {after}" if len(after) <= 10 else "")
    if missing:
        line += f"; {missing} not read by the deadline"
    return is_late, line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--messages", type=int, default=28_000)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the job (the load)")
    parser.add_argument("--late", type=float, default=30.0, help="a gap between two batches longer than this")
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
    from paired_writer import build_session

    from spark_sb.source import register

    work = Path(tempfile.mkdtemp(prefix="bench-late-"))
    queues = [f"source-{i}" for i in range(args.runs)]
    (work / "entities.yaml").write_text("queues:\n" + "".join(f"  - name: {q}\n" for q in queues))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    late_runs = 0
    try:
        namespaces = [NamespaceOptions("primary"), NamespaceOptions("secondary")]
        with EmulatorProcess.start(data_dir=None, namespaces=namespaces, entities=work / "entities.yaml") as emu:
            p, s = emu["primary"], emu["secondary"]
            config = {"primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
                      "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
                      "send_availability": {"backlog_queue_count": 1}}
            spark = build_session("spark-sb-bench-late", master="local[2]")
            spark.sparkContext.setLogLevel("ERROR")
            register(spark)
            for i, queue in enumerate(queues):
                fill(p.connection_string, queue, args.messages, f"r{i}")
                # two lock durations and then some: a straggler arrives, a lost message does not
                batches = read_all(spark, config, queue, args.messages, deadline=300.0)
                is_late, line = describe(batches, args.messages, args.late)
                late_runs += is_late
                print(f"run {i + 1}: {'LATE ' if is_late else ''}{line}", flush=True)
            spark.stop()
    finally:
        for loop in busy:
            loop.kill()
    print(f"runs with a late message: {late_runs} of {args.runs} "
          f"({args.messages} messages each, {args.busy} busy loops beside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
