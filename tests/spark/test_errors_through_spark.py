"""Every error reaches the user as what it is (issue 46, item 2).

* A rejected credential (a wrong SAS key: the administration API answers 401 ``InvalidSignature``, the CBS
  ``put-token`` 401) is raised at once by every entry point, the syphon job, the ``servicebus`` source (stream and
  batch) and the sinks (the ``servicebus`` writer, ``foreachBatch(PairedSink)``), naming the namespace, its host and
  the refusal, never the key; it is never retried as an outage (the sources' ``readRetryTimeout`` is 120 s; the
  SDK's own retries of an authentication error took 15 s). Each test bounds its wait at 60 s, half the outage
  budget, on a loaded machine; on the code before the fix the syphon ran out its 120 s and said the administration
  endpoint did not answer.
* ``spark_sb.errors.unwrap`` gets the spark-sb error back from each wrapping Spark raises it in: ``AnalysisException``
  (a source failing at ``load()``), ``PythonException`` (a batch read failing in an executor), and
  ``StreamingQueryException`` from ``awaitTermination()`` (a streaming source failing, a ``foreachBatch`` sink
  failing)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from spark_sb import jobs
from spark_sb.errors import (
    ConfigError,
    CredentialRejectedError,
    ErrorClass,
    SourceUnavailableError,
    SparkSbError,
    unwrap,
)
from spark_sb.sink import PairedSink
from spark_sb.source import config_options, register

from . import test_syphon_stream
from .conftest import sink_config

#: the fixture of the syphon's tests: a configuration whose backlog queues exist, a destination, the job's locations
setup = test_syphon_stream.setup

#: run on every Spark version make test tries (Makefile, EVERY_SPARK): the wrappings are Spark's
pytestmark = pytest.mark.every_spark

#: a key of the right form (base64) that is not the namespace's
WRONG_KEY = "d3Jvbmcta2V5LW9mLXRoZS10ZXN0cw=="
#: how long an entry point may take to say the credential was refused: far below the 120 s of an outage's retries
BOUND = 60.0


def _wrong_key(section: dict) -> dict:
    return {**section, "connection_string": re.sub(r"SharedAccessKey=[^;]*", f"SharedAccessKey={WRONG_KEY}",
                                                   section["connection_string"])}


def _names_the_refusal(text: str, side: str, info: Any) -> None:
    """``text`` says which namespace, on which host, refused the credential and how, and holds no key."""
    assert f"the {side} namespace (localhost:{info.amqp_port}) refused the credential" in text, text[-3000:]
    assert "401" in text and "signature" in text.lower(), text[-3000:]
    assert WRONG_KEY not in text and info.key not in text, text[-3000:]


def _refused(exc: BaseException, side: str, info: Any) -> CredentialRejectedError:
    error = unwrap(exc)
    assert isinstance(error, CredentialRejectedError), f"{type(exc).__name__}: {str(exc)[-3000:]}"
    assert error.error_class is ErrorClass.CONFIGURATION_CREDENTIAL and not error.retryable
    _names_the_refusal(str(error), side, info)
    return error


# --- a rejected credential, at once ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_the_syphon_job_fails_at_once_naming_the_secondary_that_refused_its_credential(
        spark: Any, setup: dict, secondary: Any, tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    # the job's check before Spark starts refuses this at once with exit 2 (tests/test_jobs.py); left out here, the
    # query's own source meets the refusal, as it does when the credential is revoked after the job started
    monkeypatch.setattr(jobs, "check_credentials", lambda config: None)
    conf = tmp_path / "syphon.json"
    conf.write_text(json.dumps({**setup["config"], "secondary": _wrong_key(setup["config"]["secondary"])}))
    interval = spark.conf.get("spark.sql.streaming.noDataProgressEventInterval")
    started = time.monotonic()
    try:
        with pytest.raises(SystemExit) as exited:
            jobs.syphon_main(["--conf", str(conf), "--until-empty", "--timeout", "300"])
    finally:
        spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", interval)
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert exited.value.code == jobs.EXIT_QUERY_FAILED, err[-3000:]
    last = [line for line in err.splitlines() if line.startswith("spark-sb-syphon: ")][-1]
    _names_the_refusal(last, "secondary", secondary)
    assert "did not answer" not in last and "readRetryTimeout" not in last, last
    assert took < BOUND, f"the refusal took {took:.0f} s: retried as an outage"


@pytest.mark.timeout(240)
def test_the_servicebus_source_refuses_a_rejected_credential_at_once(spark: Any, primary: Any, secondary: Any,
                                                                     make_queue: Any) -> None:
    register(spark)
    q = make_queue()
    config = sink_config(primary, secondary)
    config.pop("sink")
    config["primary"] = _wrong_key(config["primary"])
    options = {**config_options(config), "entity": q}
    started = time.monotonic()
    with pytest.raises(Exception) as batch:  # at load(): Spark asks the source its schema there
        spark.read.format("servicebus").options(**options).load()
    _refused(batch.value, "primary", primary)
    with pytest.raises(Exception) as stream:
        spark.readStream.format("servicebus").options(**options).load()
    _refused(stream.value, "primary", primary)
    took = time.monotonic() - started
    assert took < 2 * BOUND, f"the refusals took {took:.0f} s: retried as an outage"


@pytest.mark.timeout(240)
def test_the_writers_refuse_a_rejected_credential_at_once(spark: Any, primary: Any, secondary: Any,
                                                           make_queue: Any, tmp_path: Path) -> None:
    q = make_queue()
    config = sink_config(primary, secondary, entity=q)
    config["primary"] = _wrong_key(config["primary"])
    rows = spark.createDataFrame([("a", "m-a")], "body string, message_id string")
    started = time.monotonic()
    with pytest.raises(Exception) as written:
        rows.write.format("servicebus").options(**config_options(config)).option("entity", q).mode("append").save()
    _refused(written.value, "primary", primary)
    took = time.monotonic() - started
    assert took < BOUND, f"the writer's refusal took {took:.0f} s"

    sink = PairedSink.from_config(config)
    query = (spark.readStream.format("rate").option("rowsPerSecond", 1).load()
             .selectExpr("CAST(value AS STRING) AS body", "CAST(value AS STRING) AS message_id")
             .writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "cp")).start())
    started = time.monotonic()
    try:
        with pytest.raises(Exception) as failed:
            query.awaitTermination(BOUND)
    finally:
        query.stop()
    _refused(failed.value, "primary", primary)
    took = time.monotonic() - started
    assert took < BOUND, f"the sink's refusal took {took:.0f} s"


# --- unwrap, through each of Spark's wrappings --------------------------------------------------------------


def test_unwrap_a_source_failing_when_the_read_is_planned(spark: Any, conf: dict) -> None:
    """``AnalysisException`` (``PYTHON_DATA_SOURCE_ERROR``): the source's reader refused its options when Spark
    built it to plan the read."""
    register(spark)
    with pytest.raises(Exception) as caught:
        (spark.read.format("servicebus").options(**config_options(conf), entity="q", namespaces="tertiary").load()
         .collect())
    assert type(caught.value).__name__ == "AnalysisException", type(caught.value)
    assert "PYTHON_DATA_SOURCE_ERROR" in str(caught.value)
    error = unwrap(caught.value)
    assert isinstance(error, ConfigError) and isinstance(error, SparkSbError)
    assert str(error).startswith("namespaces: 'tertiary' is not a namespace"), str(error)
    assert not error.retryable and error.error_class is ErrorClass.OTHER
    assert error.__cause__ is caught.value


def test_unwrap_a_batch_read_failing_in_an_executor(spark: Any, emulator: Any, conf: dict, make_queue: Any) -> None:
    """``PythonException``: the read's task gave up on a namespace that stopped answering after the load."""
    register(spark)
    q = make_queue()
    df = spark.read.format("servicebus").options(**config_options(conf), entity=q, readRetryTimeout="1").load()
    emulator.fault("primary", "down", entity=q)
    try:
        with pytest.raises(Exception) as caught:
            df.collect()
    finally:
        emulator.heal("primary", entity=q)
    assert type(caught.value).__name__ in ("PythonException", "Py4JJavaError"), type(caught.value)
    error = unwrap(caught.value)
    assert isinstance(error, SourceUnavailableError), str(caught.value)[-3000:]
    assert error.retryable and error.error_class is ErrorClass.OUTAGE
    assert f"servicebus {q!r} on the primary" in str(error)


def _errors_page_block() -> str:
    """The code block of docs/errors.md that shows ``unwrap`` (the one marked as run by this file)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "errors.md").read_text()
    found = re.search(r"<!-- run by tests/spark/test_errors_through_spark.py[^>]*-->\n```python\n(.*?)\n```",
                      text, re.DOTALL)
    assert found is not None, "docs/errors.md has no block run by this test"
    return found.group(1)


def test_unwrap_a_streaming_query_and_a_foreach_batch_sink_failing(spark: Any, primary: Any, secondary: Any,
                                                                   make_queue: Any, tmp_path: Path,
                                                                   capsys: Any) -> None:
    """``StreamingQueryException`` from ``awaitTermination()``: a ``foreachBatch`` function that raised a spark-sb
    error (here the sink's ``BadInputError``: a null body, and no reject table). Then the block of docs/errors.md
    that shows ``unwrap``, run as written on that query: it prints the error and raises it as itself."""
    from spark_sb.errors import BadInputError

    q = make_queue()
    sink = PairedSink.from_config(sink_config(primary, secondary, entity=q))
    query = (spark.readStream.format("rate").option("rowsPerSecond", 1).load()
             .selectExpr("CAST(NULL AS STRING) AS body", "CAST(value AS STRING) AS message_id")
             .writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "cp")).start())
    try:
        with pytest.raises(Exception) as caught:
            query.awaitTermination(BOUND)
    finally:
        query.stop()
    assert type(caught.value).__name__ == "StreamingQueryException", type(caught.value)
    error = unwrap(caught.value)
    assert isinstance(error, BadInputError), str(caught.value)[-3000:]
    assert error.error_class is ErrorClass.BAD_MESSAGE and not error.retryable
    assert "null" in str(error)

    capsys.readouterr()
    with pytest.raises(BadInputError) as raised:  # a terminated query's awaitTermination raises its error again
        exec(_errors_page_block(), {"query": query})
    assert raised.value.__cause__ is not None and "StreamingQueryException" in type(raised.value.__cause__).__name__
    assert capsys.readouterr().out == f"BadInputError (bad-message, retryable: False): {error}\n"
