"""The syphon job: move the messages parked in the backlog queues back to the primary.

    spark-submit --packages io.delta:delta-spark_2.13:4.4.0 jobs/syphon.py --conf conf/local.yaml [--until-empty]
    # (Delta for Spark 4.2; spark_sb.capabilities.delta_package() names it for the installed delta-spark)
    python jobs/syphon.py --conf conf/local.yaml [--until-empty [--timeout SECONDS]] [--verbose | --log-config FILE]
    # a local session (local[2])

A thin wrapper over :func:`spark_sb.jobs.syphon_main` (also installed as the ``spark-sb-syphon`` command and
the entry point of the Databricks bundle's syphon job). See :mod:`spark_sb.jobs`.
"""

from __future__ import annotations

import sys

from spark_sb.jobs import await_until_empty, log_batch_steps, syphon_main
from spark_sb.jobs import start_syphon as start

__all__ = ["await_until_empty", "log_batch_steps", "main", "start"]
main = syphon_main

if __name__ == "__main__":
    sys.exit(main())
