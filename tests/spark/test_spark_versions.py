"""What each supported Spark runs (docs/where-it-runs/spark-versions.md): on Spark 4.0 and later both sources load and
register; on Spark 3.5, which has no Python data sources, the sources and the syphon job refuse with an error
naming the Spark version and what is missing, never an install hint; the sink runs everywhere (test_sink)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyspark
import pytest

from spark_sb.capabilities import admission_control, python_data_sources, trigger_available_now
from spark_sb.errors import UnsupportedSparkError

from .conftest import child_env

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark

CONF = Path(__file__).resolve().parents[2] / "conf" / "local.yaml"


#: what each Spark offers a Python data source (python_data_sources, admission_control, trigger_available_now),
#: read from its released pyspark: 4.0 and 4.1 ship pyspark.sql.datasource but not
#: pyspark.sql.streaming.datasource, and their JVM's PythonMicroBatchStream implements neither
#: SupportsAdmissionControl nor SupportsTriggerAvailableNow; 4.2 ships both; 3.5 has no Python data sources
WHAT_EACH_SPARK_OFFERS = {"3.5": (False, False, False), "4.0": (True, False, False), "4.1": (True, False, False),
                          "4.2": (True, True, True)}


def test_the_capabilities_are_what_this_spark_version_offers() -> None:
    minor = ".".join(pyspark.__version__.split(".")[:2])
    assert minor in WHAT_EACH_SPARK_OFFERS, f"Spark {pyspark.__version__}: add what it offers to the table"
    assert (python_data_sources(), admission_control(), trigger_available_now()) == WHAT_EACH_SPARK_OFFERS[minor]


@pytest.mark.skipif(not python_data_sources(), reason="Spark 3.5 has no Python data sources")
def test_the_streaming_readers_latest_offset_takes_a_start_and_a_limit_exactly_with_admission_control() -> None:
    import inspect

    from pyspark.sql.datasource import DataSourceStreamReader

    # what Spark calls: latestOffset(start, limit) on 4.2, latestOffset() on 4.0 and 4.1
    parameters = list(inspect.signature(DataSourceStreamReader.latestOffset).parameters)
    assert parameters == (["self", "start", "limit"] if admission_control() else ["self"]), parameters


@pytest.mark.skipif(not python_data_sources(), reason="Spark 3.5 has no Python data sources")
def test_both_sources_register_and_load_on_spark_4(spark, primary, secondary, make_queue) -> None:
    """Both formats load a stream with their schema (the servicebus source checks its entity at ``load()``, so it
    reads one that exists, on the emulator pair)."""
    from spark_sb import register
    from spark_sb.options import config_options
    from spark_sb.source import SCHEMA, SERVICEBUS_SCHEMA

    from .conftest import sink_config

    register(spark)
    config = sink_config(primary, secondary)
    config.pop("sink")
    queue = make_queue()
    for name, schema, extra in (("servicebus-backlog", SCHEMA, {}), ("servicebus", SERVICEBUS_SCHEMA, {"entity": queue})):
        stream = spark.readStream.format(name).options(**config_options(config), **extra).load()
        assert stream.isStreaming and stream.schema == schema


@pytest.mark.skipif(python_data_sources(), reason="Spark 4.0 and later have Python data sources")
def test_on_spark_3_5_the_sources_refuse_naming_the_version_and_what_is_missing() -> None:
    with pytest.raises(UnsupportedSparkError) as raised:
        from spark_sb import register  # noqa: F401
    message = str(raised.value)
    assert f"Spark {pyspark.__version__}" in message and "Spark 4.0 or later" in message
    assert "pyspark.sql.datasource" in message and "pip install" not in message


@pytest.mark.skipif(python_data_sources(), reason="Spark 4.0 and later have Python data sources")
def test_on_spark_3_5_the_syphon_job_exits_2_naming_the_version() -> None:
    done = subprocess.run([sys.executable, "-c", "import sys; from spark_sb.jobs import syphon_main; "
                           f"sys.exit(syphon_main(['--conf', {str(CONF)!r}]))"],
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"Spark {pyspark.__version__}" in done.stderr and "needs Spark 4.0 or later" in done.stderr
