"""The Delta pairing check: a delta-spark built for another Spark is refused at once, naming both versions and
the Delta to install (its jars would otherwise fail at the first Delta read or write)."""

from __future__ import annotations

import pytest

from spark_sb import capabilities
from spark_sb.errors import UnsupportedSparkError


@pytest.mark.parametrize(("spark", "delta", "wanted"), [
    ("4.2.0", "4.1.0", "4.4.x"),
    ("4.0.2", "4.4.0", "4.0.x"),
    ("3.5.8", "4.0.1", "3.2.x or 3.3.x"),
])
def test_a_delta_built_for_another_spark_is_refused_naming_both(monkeypatch, spark, delta, wanted) -> None:
    versions = {"pyspark": spark, "delta-spark": delta}
    monkeypatch.setattr(capabilities, "installed_version", versions.get)
    with pytest.raises(UnsupportedSparkError, match=f"delta-spark {delta} is not built for Spark {spark}: "
                       f"install delta-spark {wanted}"):
        capabilities.check_delta_pairing()


@pytest.mark.parametrize(("spark", "delta"), [("4.2.0", "4.4.0"), ("4.1.4", "4.1.0"), ("4.1.4", "4.3.1"),
                                              ("4.0.2", "4.0.1"), ("3.5.8", "3.3.2"), ("4.3.0", "4.5.0")])
def test_the_pairs_delta_publishes_pass(monkeypatch, spark, delta) -> None:
    monkeypatch.setattr(capabilities, "installed_version", {"pyspark": spark, "delta-spark": delta}.get)
    capabilities.check_delta_pairing()


@pytest.mark.parametrize(("delta", "package"), [("4.4.0", "io.delta:delta-spark_2.13:4.4.0"),
                                                ("3.3.2", "io.delta:delta-spark_2.12:3.3.2")])
def test_the_maven_package_follows_the_installed_delta(monkeypatch, delta, package) -> None:
    monkeypatch.setattr(capabilities, "installed_version", {"delta-spark": delta}.get)
    assert capabilities.delta_package() == package
