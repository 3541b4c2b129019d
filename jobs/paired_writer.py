"""The paired writer: a Structured Streaming job that sends its rows to Service Bus through the paired sink.

    spark-submit jobs/paired_writer.py --conf conf/local.yaml [--max-batches N]
    python jobs/paired_writer.py --conf conf/local.yaml          # a local session (local[2])

Reads ``sink.source`` (the rate source by default: each rate row becomes the body ``row <value>`` with the
key ``<timestamp ms>-<value>``, which is the message id: the same when a batch is replayed, never the same in
another run, even one without a checkpoint), and runs ``writeStream.foreachBatch(PairedSink)`` with
``sink.checkpoint_location`` and the ``sink.trigger`` processing-time trigger. Stops after ``--max-batches``
(or ``sink.max_batches``) batches when given.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_LOGGER = logging.getLogger("spark_sb.jobs.paired_writer")


def build_session(app_name: str = "spark-sb-paired-writer", master: str | None = None) -> Any:
    """The active session, else a new one: as is on Databricks (Delta built in), else with Delta configured
    through ``configure_spark_with_delta_pip`` (under spark-submit pass ``--packages
    io.delta:delta-spark_2.13:4.4.0``, as the JVM is already running), on ``local[2]`` when not launched by
    spark-submit."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName(app_name)
    if "DATABRICKS_RUNTIME_VERSION" in os.environ:  # Delta is built in there
        return builder.getOrCreate()
    from delta import configure_spark_with_delta_pip

    if master or "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit: a local session
        builder = builder.master(master or os.environ.get("SPARK_MASTER", "local[2]"))
        if (master or os.environ.get("SPARK_MASTER", "local")).startswith("local"):
            # a local session talks to itself over loopback (Spark would take the host's address otherwise)
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (builder.config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
               .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2"))
    return configure_spark_with_delta_pip(builder).getOrCreate()


def read_source(spark: Any, config: Any) -> Any:
    """The streaming DataFrame of ``sink.source``; rate rows are mapped to ``body`` and ``key``."""
    from pyspark.sql import functions as F

    source = config.sink.source
    if source.kind == "table":
        return spark.readStream.options(**source.options).table(source.table)
    if source.kind == "path":
        reader = spark.readStream.format(source.format).options(**source.options)
        return reader.load(source.path)
    reader = spark.readStream.format("rate").option("rowsPerSecond", source.rows_per_second)
    if source.num_partitions is not None:
        reader = reader.option("numPartitions", source.num_partitions)
    rows = reader.options(**source.options).load()
    # the key (the message id) is ``<row timestamp in ms>-<value>``: the rate source counts from 0 again in
    # every new checkpoint, but its timestamps start at the checkpoint's creation time (kept in the checkpoint),
    # so a replayed batch gets the same ids and a new run never reuses an earlier run's
    key = F.concat_ws("-", F.unix_millis(F.col("timestamp")).cast("string"), F.col("value").cast("string"))
    return rows.select(F.concat(F.lit("row "), F.col("value").cast("string")).alias("body"), key.alias("key"))


def start(spark: Any, conf: Any, foreach_batch: Callable[[Any, int], Any] | None = None,
          checkpoint: str | None = None) -> tuple[Any, Any]:
    """Start the query; returns ``(query, sink)``. ``foreach_batch`` wraps the sink when given (the demo
    uses it to print each batch's summary)."""
    from spark_sb.config import load_config
    from spark_sb.sink import PairedSink

    config = load_config(conf)
    if config.sink.source.kind == "rate" and config.sink.key_column is None and "message_id" not in config.sink.columns:
        config = load_config({**config.to_dict(secrets=True),
                              "sink": {**config.sink.to_dict(), "key_column": "key"}})
    sink = PairedSink.from_config(config)
    location = checkpoint or config.sink.checkpoint_location
    if location is None:
        location = tempfile.mkdtemp(prefix="spark-sb-checkpoint-")
        _LOGGER.warning("sink.checkpoint_location is not set; using %s (a fresh one each run)", location)
    writer = read_source(spark, config).writeStream.foreachBatch(foreach_batch or sink)
    writer = writer.option("checkpointLocation", location).queryName("spark-sb-paired-writer")
    if config.sink.trigger is not None:
        writer = writer.trigger(processingTime=f"{config.sink.trigger.total_seconds()} seconds")
    return writer.start(), sink


def await_batches(query: Any, max_batches: int | None, poll: float = 0.2, settle: float = 30.0) -> None:
    """Wait until ``max_batches`` batches completed, or until the query terminates. The query is then stopped
    between two batches (waiting up to ``settle`` seconds for the batch in flight), so that no batch is
    interrupted half-sent: it would be replayed by the next run on the same checkpoint anyway, but an
    interrupted Python batch also makes Spark 4.2's stream thread die of a StackOverflowError while it
    matches the long error text."""
    while query.isActive:
        progress = query.lastProgress
        if max_batches is not None and progress is not None and progress["batchId"] >= max_batches - 1:
            deadline = time.monotonic() + settle
            while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
                time.sleep(0.05)
            query.stop()
            break
        query.awaitTermination(poll)
    query.awaitTermination()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", type=Path, required=True, help="spark-sb YAML configuration")
    parser.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    parser.add_argument("--checkpoint", default=None, help="overrides sink.checkpoint_location")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from spark_sb.config import load_config

    config = load_config(args.conf)
    spark = build_session()
    query, sink = start(spark, config, checkpoint=args.checkpoint)
    started = time.monotonic()
    await_batches(query, args.max_batches or config.sink.max_batches)
    _LOGGER.info("stopped after %d batches in %.0f s: %s", sink.totals.batches, time.monotonic() - started,
                 sink.totals.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
