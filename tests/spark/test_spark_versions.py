"""What each supported Spark runs (README, "Spark versions"): on Spark 4.0 and later both sources load and
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


def test_what_the_capabilities_say_is_what_pyspark_ships() -> None:
    import importlib.util

    assert python_data_sources() == (importlib.util.find_spec("pyspark.sql.datasource") is not None)
    assert admission_control() == (importlib.util.find_spec("pyspark.sql.streaming.datasource") is not None)
    assert trigger_available_now() <= admission_control()


@pytest.mark.skipif(not python_data_sources(), reason="Spark 3.5 has no Python data sources")
def test_both_sources_register_and_load_on_spark_4(spark) -> None:
    from spark_sb import register
    from spark_sb.source import SCHEMA, SERVICEBUS_SCHEMA

    register(spark)
    for name, schema in (("servicebus-backlog", SCHEMA), ("servicebus", SERVICEBUS_SCHEMA)):
        stream = spark.readStream.format(name).option("conf", str(CONF)).load()
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
