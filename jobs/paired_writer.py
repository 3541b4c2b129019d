"""The paired writer: a Structured Streaming job that sends its rows to Service Bus through the paired sink.

    spark-submit --packages io.delta:delta-spark_2.13:4.4.0 jobs/paired_writer.py --conf conf/local.yaml
    # (Delta for Spark 4.2; spark_sb.capabilities.delta_package() names it for the installed delta-spark)
    python jobs/paired_writer.py --conf conf/local.yaml [--max-batches N] [--verbose | --log-config FILE]
    # a local session (local[2]); --max-batches N: N batches of this run

A thin wrapper over :func:`spark_sb.jobs.writer_main` (also installed as the ``spark-sb-writer`` command and
the entry point of the Databricks bundle's writer job). See :mod:`spark_sb.jobs`.
"""

from __future__ import annotations

import sys

from spark_sb.jobs import await_batches, build_session, read_source, writer_main
from spark_sb.jobs import start_writer as start

__all__ = ["await_batches", "build_session", "main", "read_source", "start"]
main = writer_main

if __name__ == "__main__":
    sys.exit(main())
