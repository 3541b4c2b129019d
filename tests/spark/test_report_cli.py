"""``spark-sb report`` over Delta tables of the sink's metrics schema and the syphon's ledger schema."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from spark_sb import cli
from spark_sb.republisher import LEDGER_DDL
from spark_sb.sink import METRICS_SCHEMA

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark

T0 = datetime.datetime(2026, 11, 23, 18, 0, tzinfo=datetime.UTC)
QUEUE = "x-servicebus-transfer/0"


def _metrics_row(batch_id: int, primary: int, parked: int, failovers: int, failed_over: list[str]) -> tuple:
    """A row as PairedSink._write_metrics writes it (METRICS_SCHEMA's order)."""
    rows = primary + parked
    return (batch_id, T0 + datetime.timedelta(seconds=2 * batch_id), rows, rows, primary, 0, 0, failovers, 0, 0, 0,
            0, {QUEUE: parked} if parked else {}, failed_over, 2, 0.5)


def test_report_draws_the_tables_of_a_run_and_names_bad_options(spark: Any, tmp_path: Path, capsys: Any) -> None:
    metrics, ledger = str(tmp_path / "metrics"), str(tmp_path / "ledger")
    rows = [_metrics_row(0, 50, 0, 0, []), _metrics_row(1, 10, 40, 1, ["orders"]),
            _metrics_row(2, 0, 50, 0, ["orders"]), _metrics_row(3, 50, 0, 0, [])]
    spark.createDataFrame(rows, METRICS_SCHEMA).write.format("delta").save(metrics)
    recorded = T0 + datetime.timedelta(seconds=12)
    spark.createDataFrame([(f"m{i}", QUEUE, i, "orders", "delivered", None, None, 0, T0, recorded)
                           for i in range(90)], LEDGER_DDL).write.format("delta").save(ledger)

    out = tmp_path / "outage.png"
    assert cli.main(["report", "--metrics", metrics, "--ledger", ledger, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert capsys.readouterr().out.strip() == (
        f"wrote {out}: 4 sink batches (110 rows to the primary, 90 to backlog queues), outages: batches 1-2; "
        "the syphon moved 90 messages in 1 batch")

    missing_dir = tmp_path / "no-such-dir" / "x.png"
    bad = [
        (["--metrics", str(tmp_path / "nothing"), "--ledger", ledger, "--out", str(out)],
         f"spark-sb report: --metrics: no Delta table at this path, got {tmp_path / 'nothing'}"),
        (["--metrics", metrics, "--ledger", "no_such_ledger", "--out", str(out)],
         "spark-sb report: --ledger: no such table (a path needs a '/' or a scheme), got no_such_ledger"),
        (["--metrics", ledger, "--ledger", ledger, "--out", str(out)],
         f"spark-sb report: --metrics: {ledger} is not a metrics table (sink.metrics_table): it misses the columns "
         "finished_at, primary, backlog, failovers, failed_over"),
        (["--metrics", metrics, "--ledger", ledger, "--out", str(missing_dir)],
         f"spark-sb report: --out: the directory {missing_dir.parent} does not exist, got {missing_dir}"),
    ]
    for args, expected in bad:
        assert cli.main(["report", *args]) == 2, args
        assert capsys.readouterr().err.strip() == expected
