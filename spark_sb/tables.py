"""Delta tables named by the configuration: a path (it has a ``/`` or a scheme: ``/chk/x``, ``data/x``,
``abfss://...``, ``dbfs:/...``) or a catalog table name (``[catalog.][schema.]table``, e.g. in Unity Catalog).
Used for the sink's reject and metrics tables, the syphon's ledger and ``spark-sb report``."""

from __future__ import annotations

from typing import Any


def is_path(location: str) -> bool:
    """Whether ``location`` names a path (else a table name)."""
    return "/" in location or ":" in location


def read(spark: Any, location: str) -> Any | None:
    """The DataFrame of the Delta table at ``location``, or None when there is none (yet). A table name Spark
    cannot parse raises Spark's error."""
    if is_path(location):
        from delta.tables import DeltaTable

        if not DeltaTable.isDeltaTable(spark, location):
            return None
        return spark.read.format("delta").load(location)
    if not spark.catalog.tableExists(location):
        return None
    return spark.read.table(location)


def append(df: Any, location: str, *, merge_schema: bool = False) -> None:
    """Append ``df`` to the Delta table at ``location``, creating it when missing; ``merge_schema`` lets a
    table written before a column was added take the new column."""
    writer = df.write.format("delta").mode("append")
    if merge_schema:
        writer = writer.option("mergeSchema", "true")
    if is_path(location):
        writer.save(location)
    else:
        writer.saveAsTable(location)


def local_path(location: str) -> str | None:
    """``location`` as an absolute local path when it names one (no scheme, or ``file:``), else None."""
    if not is_path(location):
        return None
    if location.startswith("file:"):
        location = location[len("file:"):]
        location = "/" + location.lstrip("/") if location.startswith("//") or location.startswith("/") else location
    elif ":" in location.split("/", 1)[0]:
        return None  # abfss://, dbfs:/, s3://...
    import os

    return os.path.abspath(location)


def append_without_spark(location: str, table: Any) -> None:
    """Append the Arrow ``table`` to the Delta table at the local path ``location`` (creating it when missing;
    new columns merged) with delta-rs, where no SparkSession is at hand (a Python data source's ``commit``).
    Spark reads and appends to the same table as to one it wrote."""
    from deltalake import write_deltalake

    write_deltalake(location, table, mode="append", schema_mode="merge")


def append_once(location: str, table: Any, app_id: str, version: int) -> bool:
    """:func:`append_without_spark` at most once for ``(app_id, version)``: the append records them in the
    table's log as Delta's idempotent writes do (a ``txn`` action, as Spark's ``txnAppId``/``txnVersion``), and
    a table that already has ``version`` or a later one for ``app_id`` is left as it is (a replayed batch, a
    retried task). Returns whether it appended."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
    from deltalake.exceptions import TableNotFoundError

    try:
        done = DeltaTable(location).transaction_version(app_id)
    except TableNotFoundError:
        done = None
    if done is not None and done >= version:
        return False
    write_deltalake(location, table, mode="append", schema_mode="merge",
                    commit_properties=CommitProperties(app_transactions=[Transaction(app_id=app_id, version=version)]))
    return True
