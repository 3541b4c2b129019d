"""What the ``servicebus`` and ``servicebus-backlog`` sources cannot do is refused before the query starts, at
``load()`` (Spark calls a Python source's ``schema()`` there, batch or stream), as the writer refuses it: a misspelt
option with a did-you-mean, a session-enabled entity naming it. An error only the stream's reader can raise arrives
as itself, not as PySpark's ``UnboundLocalError``. What the user catches is Spark's ``AnalysisException`` (at
``load()``) or ``StreamingQueryException``, whose message holds spark-sb's."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.errors import AnalysisException, StreamingQueryException

from spark_sb.config import load_config
from spark_sb.source import config_options, register

#: run on every Spark version make test tries (Makefile, EVERY_SPARK): when Spark calls the source is its API's
pytestmark = pytest.mark.every_spark


@pytest.fixture
def fmt(spark: Any, conf: dict) -> Any:
    """``fmt(stream, source)``: a reader of ``source`` (batch, or stream) over the emulator pair, by reference."""
    register(spark)
    return lambda stream, source="servicebus": ((spark.readStream if stream else spark.read).format(source)
                                                .options(**config_options(conf)))


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_a_misspelt_option_is_refused_at_load_with_a_did_you_mean(fmt, make_queue, stream) -> None:
    """(Before: a batch read with ``maxMesages`` returned every message; the stream started.) Spark hands the
    options over lower-cased, so the error names the key as Spark has it."""
    with pytest.raises(AnalysisException) as caught:
        fmt(stream).option("entity", make_queue()).option("maxMesages", "5").load()
    assert "maxmesages: is not an option of the servicebus source (did you mean maxMessages?)" in str(caught.value)
    with pytest.raises(AnalysisException) as caught:
        fmt(True, "servicebus-backlog").option("maxMesagesPerTrigger", "5").load()
    assert ("maxmesagespertrigger: is not an option of the servicebus-backlog source (did you mean "
            "maxMessagesPerTrigger?)") in str(caught.value)


def test_a_session_entity_is_refused_at_load_naming_it_and_its_namespace(fmt, conf, make_queue) -> None:
    """(Before: a stream started, and ``awaitTermination`` ended in ``UnboundLocalError``.)"""
    queue = make_queue(requires_session=True)
    host = load_config(conf).primary.fully_qualified_namespace
    for stream in (False, True):
        with pytest.raises(AnalysisException) as caught:
            fmt(stream).option("entity", queue).load()
        assert f"entity: requires sessions on the primary ({host})" in str(caught.value)
        assert f"got {queue}" in str(caught.value)


def test_what_only_the_stream_reader_refuses_fails_the_query_as_itself(fmt, make_queue, tmp_path) -> None:
    """A stream of a dead-letter queue (a batch read takes it, so ``load()`` cannot tell): the query fails with
    the ConfigError itself. (Before: with ``UnboundLocalError: cannot access local variable 'reader'``.)"""
    query = (fmt(True).option("entity", f"{make_queue()}/$DeadLetterQueue").load().writeStream.format("noop")
             .option("checkpointLocation", str(tmp_path / "ck")).start())
    with pytest.raises(StreamingQueryException) as caught:
        query.awaitTermination(60)
    assert "ConfigError: entity: is a dead-letter queue, which the servicebus source reads in batch only" in str(
        caught.value)
    assert "UnboundLocalError" not in str(caught.value)
