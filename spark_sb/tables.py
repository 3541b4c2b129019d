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
