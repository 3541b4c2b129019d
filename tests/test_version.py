"""The version in one place: ``spark_sb.__version__``. The wheel's metadata (what ``pip show spark-sb`` and
``importlib.metadata.version("spark-sb")`` report once installed) takes it from there, and ``spark-sb --version``
prints it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_packaging import ROOT, build_wheel, wheel_metadata

import spark_sb
from spark_sb import cli


def _metadata_version(wheel: Path) -> str:
    versions = [line.split(":", 1)[1].strip() for line in wheel_metadata(wheel) if line.startswith("Version:")]
    assert len(versions) == 1, f"{wheel.name}: Version lines {versions}"
    return versions[0]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.getbasetemp() / "spark-sb-wheel")


def test_the_version_is_a_release_number() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?", spark_sb.__version__), \
        spark_sb.__version__


def test_pyproject_names_no_version_of_its_own() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml repeats the version: keep it in spark_sb.__version__"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "spark_sb.__version__"}


def test_the_wheel_carries_spark_sb_version(wheel: Path) -> None:
    assert _metadata_version(wheel) == spark_sb.__version__
    assert wheel.name.startswith(f"spark_sb-{spark_sb.__version__}-")


def test_a_new_version_in_spark_sb_alone_reaches_the_wheel(tmp_path: Path) -> None:
    """Bumping ``__version__`` and nothing else gives a wheel of the new version (pyproject.toml follows)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "spark_sb", source / "spark_sb", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    init = source / "spark_sb" / "__init__.py"
    text = init.read_text()
    assert text.count(f'__version__ = "{spark_sb.__version__}"') == 1
    init.write_text(text.replace(f'__version__ = "{spark_sb.__version__}"', '__version__ = "97.3.1"'))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-w", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (built,) = tmp_path.glob("*.whl")
    assert _metadata_version(built) == "97.3.1"


def test_spark_sb_version_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"spark-sb {spark_sb.__version__}"


def test_the_changelog_has_an_entry_for_the_version_and_the_manual_shows_it() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", changelog, re.MULTILINE)
    assert versions and versions[0] == "Unreleased", versions
    assert spark_sb.__version__ in versions, f"CHANGELOG.md has no '## [{spark_sb.__version__}]' entry: {versions}"
    assert '--8<-- "CHANGELOG.md"' in (ROOT / "docs" / "changelog.md").read_text()
