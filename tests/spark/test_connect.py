"""The sink as a streaming foreachBatch, and the servicebus format's writers (stream and batch, Spark 4.0 and
later), through a local Spark Connect server (Databricks serverless and shared clusters run Connect: the RDD API
does not exist there, and the foreachBatch function runs in a Python process of the server, not in the client).
Runs in a child process, because a local Connect server cannot share this process with the classic session of the
other tests."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spark_sb.capabilities import delta_package, python_data_sources

from .conftest import child_env, one_heavy_spark_test, receive_all, sink_config

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark

SCRIPT = textwrap.dedent("""
    import json, sys
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from spark_sb.sink import PairedSink

    config, work, package = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    spark = (SparkSession.builder.remote("local[2]")
             .config("spark.jars.packages", package)
             .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
             .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
             .config("spark.ui.enabled", "false").getOrCreate())
    # three files of 20 rows; every tenth row has no body (a row the sink rejects)
    for f in range(3):
        spark.range(f * 20, f * 20 + 20, numPartitions=2).select(
            F.when(F.col("id") % 10 != 9, F.concat(F.lit("connect "), F.col("id"))).alias("body"),
            F.col("id").cast("string").alias("key")).coalesce(1).write.mode("append").parquet(work + "/input")
    schema = spark.read.parquet(work + "/input").schema
    sink = PairedSink.from_config(config)
    query = (spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(work + "/input")
             .writeStream.foreachBatch(sink).option("checkpointLocation", work + "/checkpoint")
             .trigger(availableNow=True).start())
    query.awaitTermination()
    metrics = spark.read.format("delta").load(config["sink"]["metrics_table"]).orderBy("batch_id")
    rejects = spark.read.format("delta").load(config["sink"]["reject_table"])
    result = {
        "session": type(spark).__module__,
        "metrics": [{k: r[k] for k in ("batch_id", "rows", "primary", "rejected", "partitions")}
                    for r in metrics.collect()],
        "rejects": sorted((r["message_id"], r["reason"]) for r in rejects.collect()),
    }
    if len(sys.argv) > 4:  # the servicebus format's writers (Spark 4.0 and later): the same input, another entity
        from spark_sb.source import config_options, register

        writer = json.loads(sys.argv[4])
        register(spark)
        options = {**config_options(writer), "keyColumn": "key"}
        query = (spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(work + "/input")
                 .writeStream.format("servicebus").options(**options)
                 .option("checkpointLocation", work + "/writer-checkpoint").trigger(availableNow=True).start())
        query.awaitTermination()
        spark.read.parquet(work + "/input").where("body is not null").write.format("servicebus") \
            .options(**options).mode("append").save()  # again, as a batch: duplicates of the stream's
        written = spark.read.format("delta").load(writer["sink"]["metrics_table"])
        result["writer_metrics"] = sorted((r["rows"], r["primary"], r["rejected"]) for r in written.collect())
    print("RESULT " + json.dumps(result))
    spark.stop()
""")


def _packages() -> str:
    """Delta's jars, and Spark Connect's server where pyspark does not ship it (Spark 3.5's pip package)."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    packages = [delta_package()]
    if not any(jars.glob("spark-connect_*.jar")):
        [core] = jars.glob("spark-core_*.jar")  # spark-core_<scala>-<version>.jar
        scala = core.name.split("_")[1].split("-")[0]
        packages.append(f"org.apache.spark:spark-connect_{scala}:{pyspark.__version__}")
    return ",".join(packages)


#: the Connect job's bound: alone it takes 90 to 130 s here; beside make test's other suites 156 to 268 s, and once
#: more than 280 s (Spark 4.1, right after 4.0's, while the tests without Spark and a Spark 3.5 install ran)
JOB_TIMEOUT = 480


@pytest.mark.slow
@pytest.mark.timeout(420 + JOB_TIMEOUT + 60)  # one_heavy_spark_test's wait, the job, the checks
def test_foreach_batch_sink_and_the_format_writers_under_spark_connect_with_reject_and_metrics_tables(primary, secondary, make_queue,
                                                                               tmp_path: Path) -> None:
    q = make_queue(requires_duplicate_detection=True)
    config = sink_config(primary, secondary, entity=q, key_column="key",
                         reject_table=str(tmp_path / "rejects"), metrics_table=str(tmp_path / "metrics"))
    env = child_env(SPARK_LOCAL_IP="127.0.0.1")
    args = [sys.executable, "-c", SCRIPT, json.dumps(config), str(tmp_path), _packages()]
    if python_data_sources():  # and the servicebus format's writers, into a queue of their own
        q2 = make_queue(requires_duplicate_detection=True)
        args.append(json.dumps(sink_config(primary, secondary, entity=q2, reject_table=str(tmp_path / "w-rejects"),
                                           metrics_table=str(tmp_path / "w-metrics"))))
    with one_heavy_spark_test():  # remote('local') always binds 15002, which the other versions' suites use too
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=JOB_TIMEOUT, env=env)
        except subprocess.TimeoutExpired as late:  # what it did by then: its batches log to stderr
            output = (late.stderr or b"").decode()[-4000:]
            pytest.fail(f"the Connect job ran over {JOB_TIMEOUT} s; its last output:\n{output}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["session"].startswith("pyspark.sql.connect")

    # one metrics row per file-batch: 20 rows, 18 sent to the primary, 2 rejected
    assert [(m["rows"], m["primary"], m["rejected"]) for m in result["metrics"]] == [(20, 18, 2)] * 3
    assert [m["batch_id"] for m in result["metrics"]] == [0, 1, 2]
    poison = [i for i in range(60) if i % 10 == 9]
    assert [m for m, _ in result["rejects"]] == sorted(str(i) for i in poison)
    assert all("body" in reason for _, reason in result["rejects"]), result["rejects"]
    # every other row arrived once; the summaries also reached the server's log
    ids = sorted(int(str(m.message_id)) for m in receive_all(primary.connection_string, q, expected=54))
    assert ids == [i for i in range(60) if i not in poison]
    for batch in range(3):
        assert f"batch {batch}: 20 rows: 18 -> primary, 2 rejected" in done.stderr, done.stderr[-3000:]
    if python_data_sources():
        # the stream writer: three batches as the sink's, then the batch write of the 54 good rows once more
        assert result["writer_metrics"] == sorted([[20, 18, 2]] * 3 + [[54, 54, 0]])
        arrived = sorted(int(str(m.message_id)) for m in receive_all(primary.connection_string, q2, expected=54))
        assert arrived == [i for i in range(60) if i not in poison]  # the batch write's were duplicates
        assert "servicebus writer batch 2: 20 rows: 18 -> primary, 2 rejected" in done.stderr
