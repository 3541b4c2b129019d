"""The sink through a local Spark Connect session (Databricks serverless and shared clusters run Connect,
where the RDD API does not exist): mapInArrow-based sending works there. Runs in a child process, because a
local Connect server cannot share this process with the classic session of the other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import receive_all, sink_config

SCRIPT = textwrap.dedent("""
    import json, sys
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from spark_sb.sink import PairedSink

    spark = SparkSession.builder.remote("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    assert spark.is_connect if hasattr(spark, "is_connect") else True
    sink = PairedSink.from_config(json.loads(sys.argv[1]))
    df = spark.range(50, numPartitions=2).select(
        F.concat(F.lit("connect "), F.col("id")).alias("body"), F.col("id").cast("string").alias("key"))
    summary = sink(df, 0)
    print("SUMMARY " + json.dumps({"rows": summary.rows, "primary": summary.primary,
                                   "partitions": summary.partitions, "session": type(spark).__module__}))
    spark.stop()
""")


@pytest.mark.slow
def test_the_sink_sends_through_a_spark_connect_session(primary, secondary, make_queue) -> None:
    q = make_queue()
    config = sink_config(primary, secondary, entity=q, key_column="key")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(config)], capture_output=True, text=True,
                          timeout=240, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    assert summary["session"].startswith("pyspark.sql.connect")
    assert (summary["rows"], summary["primary"], summary["partitions"]) == (50, 50, 2)
    ids = sorted(int(str(m.message_id)) for m in receive_all(primary.connection_string, q, expected=50))
    assert ids == list(range(50))
