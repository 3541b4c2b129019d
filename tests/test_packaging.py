"""Packaging as a user meets it: ``pip wheel .`` gives one wheel; installed without extras (``pip install spark-sb``,
as on a cluster) it gives the Spark-free core (``import spark_sb``, the ``spark-sb`` command) without the emulator's
python-qpid-proton, and its job entry points (the Databricks bundle's python_wheel_tasks) ask for
``spark-sb[spark]`` and the emulator's commands for ``spark-sb[emulator]`` instead of failing with a traceback.
With ``[emulator]`` added, the emulator runs and the SDK sends and receives through it.

The wheel is built once per session (:func:`build_wheel`, shared with tests/test_bundle.py) from a copy of the
package's sources, so that a stale ``build/`` directory of the working tree cannot slip into it."""

from __future__ import annotations

import configparser
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LOGGER = logging.getLogger(__name__)

#: the console scripts the package declares: the CLI, and the two jobs (spark-submit wrappers and Databricks)
SCRIPTS = {"spark-sb": "spark_sb.cli:main", "spark-sb-writer": "spark_sb.jobs:writer_main",
           "spark-sb-syphon": "spark_sb.jobs:syphon_main"}
SPARK_ONLY = ("pyspark", "py4j", "delta", "pyarrow", "pandas")
SPARK_EXTRA = "pip install 'spark-sb[spark]'"
#: the [emulator] extra's distributions and their top-level modules
EMULATOR_DISTS = ("python-qpid-proton", "cryptography", "pyjwt", "websockets", "defusedxml")
EMULATOR_MODULES = ("proton", "cproton", "_cproton", "cryptography", "jwt", "websockets", "defusedxml")
EMULATOR_EXTRA = "spark-sb emulator needs the emulator extra: pip install 'spark-sb[emulator]' (No module named 'proton')"


def build_wheel(dest: Path) -> Path:
    """``pip wheel <sources> --no-deps`` into ``dest`` (once: a wheel already there is returned). The sources are
    pyproject.toml, README.md and spark_sb/ copied without caches."""
    built = sorted(dest.glob("*.whl"))
    if built:
        return built[0]
    source = dest / "source"
    source.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "spark_sb", source / "spark_sb", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-w", str(dest)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    _LOGGER.info("wheel built in %.1f s", time.monotonic() - started)
    shutil.rmtree(source)
    wheels = sorted(dest.glob("*.whl"))
    assert len(wheels) == 1, f"pip wheel . gave {[w.name for w in wheels]}, expected one wheel"
    return wheels[0]


def wheel_entry_points(wheel: Path) -> dict[str, str]:
    """``{name: "module:function"}`` of the wheel's console_scripts (its dist-info/entry_points.txt)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert len(names) == 1, f"{wheel.name} has no single entry_points.txt: {names}"
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep the names' case
        parser.read_string(archive.read(names[0]).decode("utf-8"))
    return dict(parser["console_scripts"]) if parser.has_section("console_scripts") else {}


def wheel_metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return archive.read(name).decode("utf-8").splitlines()


def wheel_requires(wheel: Path) -> dict[str | None, set[str]]:
    """The projects the wheel's Requires-Dist names, per extra (``None``: the core, what ``pip install spark-sb``
    brings), lower case."""
    found: dict[str | None, set[str]] = {}
    for line in wheel_metadata(wheel):
        if line.startswith("Requires-Dist:"):
            requirement = line.split(":", 1)[1].strip()
            extra = re.search(r'extra == "([^"]+)"', requirement)
            found.setdefault(extra.group(1) if extra else None, set()).add(_project(requirement))
    return found


def _project(requirement: str) -> str:
    """The project name a Requires-Dist line starts with, lower case."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return match.group(0).lower()


def resolve(target: str) -> object:
    """The object a ``module:attribute`` entry point names, imported here."""
    module, _, attribute = target.partition(":")
    found: object = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.getbasetemp() / "spark-sb-wheel")


def test_pip_wheel_gives_one_wheel_with_the_package_and_the_three_commands(wheel: Path) -> None:
    assert wheel.name.startswith("spark_sb-") and wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        files = archive.namelist()
    assert "spark_sb/__init__.py" in files and "spark_sb/jobs.py" in files and "spark_sb/emulator/__init__.py" in files
    assert "spark_sb/py.typed" in files, "the wheel marks the package as typed (PEP 561)"
    assert not [f for f in files if f.split("/")[0] in ("tests", "jobs", "bench", "conf")], "only the package ships"
    points = wheel_entry_points(wheel)
    assert points == SCRIPTS
    for name, target in points.items():
        assert callable(resolve(target)), f"{name} = {target} is not a callable of the package"


def test_the_core_requires_no_spark_and_no_emulator_and_the_extras_add_them(wheel: Path) -> None:
    requires = wheel_requires(wheel)
    assert "azure-servicebus" in requires[None]
    assert not requires[None] & {*SPARK_ONLY, "delta-spark", *EMULATOR_DISTS}, requires[None]
    assert requires["spark"] >= {"pyspark", "delta-spark", "pyarrow", "pandas"}
    assert requires["emulator"] == set(EMULATOR_DISTS)
    assert requires["delta-rs"] == {"deltalake"} and "deltalake" not in requires["spark"] | requires[None]
    # the development environment (make demo, make test) has the emulator: dev requires spark-sb[emulator,...]
    [itself] = [line for line in wheel_metadata(wheel)
                if line.startswith("Requires-Dist: spark-sb[") and 'extra == "dev"' in line]
    assert "emulator" in re.findall(r"[\w-]+", itself.split("[", 1)[1].split("]")[0]), itself


# --- the wheel in fresh virtual environments without pyspark ----------------------------------------------------

def _fresh_venv(venv: Path, *requirements: str) -> Path:
    """A new virtual environment at ``venv`` with each of ``requirements`` pip-installed in turn (from PyPI or pip's
    cache); its bin directory. The venv is made without its own pip (ensurepip costs 4 s): this interpreter's pip
    installs into it."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    for requirement in requirements:
        result = _pip(venv / "bin", "install", "--quiet", requirement, timeout=600)
        assert result.returncode == 0, f"pip install {requirement} failed:\n{result.stderr[-3000:]}"
    _LOGGER.info("fresh venv + pip install %s: %.1f s", " + ".join(Path(r).name for r in requirements),
                 time.monotonic() - started)
    return venv / "bin"


def _pip(bin_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """This interpreter's pip run on the venv of ``bin_dir``."""
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bare_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install spark-sb``: the wheel and its core dependencies only, as on a cluster."""
    return _fresh_venv(tmp_path_factory.mktemp("bare-venv"), str(wheel))


@pytest.fixture(scope="module")
def emulator_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The core install, then ``pip install 'spark-sb[emulator]'`` on top of it (the wheel with the extra)."""
    return _fresh_venv(tmp_path_factory.mktemp("emulator-venv"), str(wheel), f"{wheel}[emulator]")


def _run(bin_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    command = [str(bin_dir / args[0]), *args[1:]]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=bin_dir.parent)


def _required_by(pip_show: str) -> dict[str, set[str]]:
    """``{distribution: the installed distributions that require it}`` from ``pip show``'s output, lower case."""
    found: dict[str, set[str]] = {}
    for block in pip_show.split("\n---\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        found[fields["Name"].lower()] = {d.strip().lower() for d in fields.get("Required-by", "").split(",") if d.strip()}
    return found


@pytest.mark.slow
def test_without_extras_the_core_imports_without_pyspark_or_the_emulator(bare_venv: Path) -> None:
    code = ("import importlib.util, json, sys, spark_sb\n"
            "from spark_sb import PairedSender, Syphon, load_config, ConfigError\n"
            "from spark_sb.replication import ReplicatingSender, DedupeReceiver\n"
            "import spark_sb.config, spark_sb.paired, spark_sb.bus, spark_sb.admin, spark_sb.cli, spark_sb.jobs\n"
            "spark_sb.cli.build_parser()\n"
            f"absent, unloaded = {SPARK_ONLY + ('proton', 'cproton')!r}, {SPARK_ONLY + EMULATOR_MODULES!r}\n"
            "print(json.dumps({'installed': [m for m in absent if importlib.util.find_spec(m)],\n"
            "                  'loaded': sorted(m for m in sys.modules if m.split('.')[0] in unloaded\n"
            "                                  or m.startswith('spark_sb.emulator')),\n"
            "                  'from': spark_sb.__file__}))")
    found = _run(bare_venv, "python", "-c", code)
    assert found.returncode == 0, found.stderr
    report = json.loads(found.stdout)
    assert report["installed"] == [], "neither pyspark nor python-qpid-proton comes with pip install spark-sb"
    assert report["loaded"] == [], "the core imports no Spark, no emulator and none of the emulator's dependencies"
    assert report["from"].startswith(str(bare_venv.parent)), "spark_sb must come from the installed wheel"

    assert _pip(bare_venv, "show", "python-qpid-proton").returncode == 1, "python-qpid-proton is not installed"
    # cryptography and PyJWT are azure-identity's (through msal) too: if present, spark-sb is not why
    shown = _pip(bare_venv, "show", "cryptography", "PyJWT")
    for dist, required_by in _required_by(shown.stdout).items():
        assert required_by and "spark-sb" not in required_by, f"{dist} is required by {sorted(required_by)}"

    cli_help = _run(bare_venv, "spark-sb", "--help")
    assert cli_help.returncode == 0 and "emulator" in cli_help.stdout, cli_help.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    # free ports and no data: where the emulator would start after all, it runs until the timeout and fails the test
    ["emulator", "start", "--in-memory", "--namespace", "primary=0:0"],
    ["emulator", "fault", "--admin", "http://localhost:5300", "down"],
    ["emulator", "heal", "--admin", "http://localhost:5300"]], ids=["start", "fault", "heal"])
def test_without_the_emulator_extra_the_emulator_commands_name_it(bare_venv: Path, command: list[str]) -> None:
    ran = _run(bare_venv, "spark-sb", *command, timeout=20)
    assert (ran.returncode, ran.stderr) == (2, EMULATOR_EXTRA + "\n"), ran.stderr


@pytest.mark.slow
def test_without_the_emulator_extra_importing_the_emulator_names_it(bare_venv: Path) -> None:
    imported = _run(bare_venv, "python", "-c", "from spark_sb.emulator import EmulatorProcess")
    assert imported.returncode == 1
    assert imported.stderr.splitlines()[-1] == f"ModuleNotFoundError: {EMULATOR_EXTRA}", imported.stderr


@pytest.mark.slow
def test_with_the_emulator_extra_the_emulator_sends_and_receives(emulator_venv: Path, tmp_path: Path) -> None:
    code = ("import importlib.util, json, spark_sb.emulator\n"
            f"print(json.dumps([m for m in {SPARK_ONLY!r} if importlib.util.find_spec(m)]))")
    found = _run(emulator_venv, "python", "-c", code)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == [], "the emulator extra brings no Spark"

    entities = tmp_path / "entities.yaml"
    entities.write_text("queues:\n  - name: orders\n")
    emulator = subprocess.Popen(
        [str(emulator_venv / "spark-sb"), "emulator", "start", "--in-memory", "--entities", str(entities),
         "--namespace", "primary=0:0", "--namespace", "secondary=0:0", "-v"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert emulator.stdout is not None
        lines = dict(emulator.stdout.readline().strip().split(" ", 1) for _ in range(2))
        assert set(lines) == {"primary", "secondary"}, lines
        round_trip = (
            "import sys\n"
            "from azure.servicebus import ServiceBusClient, ServiceBusMessage\n"
            "with ServiceBusClient.from_connection_string(sys.argv[1]) as client:\n"
            "    client.get_queue_sender('orders').send_messages(ServiceBusMessage('hello', message_id='m-1'))\n"
            "    with client.get_queue_receiver('orders', max_wait_time=5) as receiver:\n"
            "        got = receiver.receive_messages(max_message_count=1, max_wait_time=5)\n"
            "        for message in got:\n"
            "            receiver.complete_message(message)\n"
            "        print([(m.message_id, str(m)) for m in got])\n")
        sent = _run(emulator_venv, "python", "-c", round_trip, lines["primary"], timeout=60)
        if sent.returncode:
            emulator.terminate()
            log = emulator.communicate(timeout=15)[1]
            pytest.fail(f"send and receive failed:\n{sent.stderr[-3000:]}\nemulator log:\n{log[-3000:]}")
        assert sent.stdout.strip() == "[('m-1', 'hello')]"
    finally:
        emulator.terminate()
        emulator.wait(15)
    assert emulator.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("job", ["spark-sb-writer", "spark-sb-syphon"])
def test_without_pyspark_a_job_entry_point_asks_for_the_spark_extra(bare_venv: Path, job: str) -> None:
    helped = _run(bare_venv, job, "--help")
    assert helped.returncode == 0 and "--conf" in helped.stdout, helped.stderr
    assert "Traceback" not in helped.stdout + helped.stderr
    ran = _run(bare_venv, job, "--conf", str(ROOT / "conf" / "local.yaml"))
    assert ran.returncode == 2
    assert SPARK_EXTRA in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr
