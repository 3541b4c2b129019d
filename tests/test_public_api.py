"""The public API, and the layering style.md asks for: the Spark-free parts load without pyspark, and no
module of the package imports one that imports it back."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import spark_sb

PACKAGE = Path(spark_sb.__file__).parent


def test_every_public_name_loads() -> None:
    assert set(spark_sb.__all__) >= {"PairedSink", "PairedSender", "Syphon", "load_config", "register",
                                     "SparkSbError", "ConfigError", "BadMessageError", "CredentialRejectedError"}
    for name in spark_sb.__all__:
        assert getattr(spark_sb, name) is not None, name
    assert set(spark_sb.__all__) == {*spark_sb._EXPORTS, "__version__"}
    assert issubclass(spark_sb.ConfigError, spark_sb.SparkSbError)


def test_the_senders_the_syphon_core_the_dedupe_receiver_and_the_configuration_load_without_pyspark() -> None:
    code = ("import sys, spark_sb\n"
            "spark_sb.PairedSender, spark_sb.Syphon, spark_sb.load_config, spark_sb.SparkSbError\n"
            "import spark_sb.syphon, spark_sb.paired, spark_sb.messages\n"
            "from spark_sb.replication import ReplicatingSender, DedupeReceiver, ReplicationError\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'py4j', 'delta')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_spark_edge_without_pyspark_says_which_extra_to_install() -> None:
    code = ("import sys\n"
            "class Gone:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('pyspark', 'pyarrow'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Gone())\n"
            "try:\n"
            "    from spark_sb import PairedSink\n"
            "except ImportError as err:\n"
            "    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "spark_sb.PairedSink needs Spark: pip install 'spark-sb[spark]'" in out, out


#: the [emulator] extra's top-level modules (python-qpid-proton, cryptography, PyJWT)
EMULATOR_ONLY = ("proton", "cproton", "_cproton", "cryptography", "jwt")
EMULATOR_EXTRA = "spark-sb emulator needs the emulator extra: pip install 'spark-sb[emulator]' (No module named 'proton')"


def test_without_the_emulator_extra_every_other_module_imports_and_the_emulator_commands_name_the_extra() -> None:
    """A core install (a cluster) has none of the emulator extra's modules: they are made unfindable here."""
    modules = sorted(_module_name(p) for p in PACKAGE.rglob("*.py") if "emulator" not in p.relative_to(PACKAGE).parts)
    assert {"spark_sb.cli", "spark_sb.config", "spark_sb.admin", "spark_sb.bus", "spark_sb.paired"} <= set(modules)
    code = ("import contextlib, importlib, io, json, sys\n"
            "class Gone:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.split('.')[0] in {EMULATOR_ONLY!r}:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Gone())\n"
            "failed = {}\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception as err:\n"
            "        failed[name] = repr(err)\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('spark_sb.emulator'))\n"
            "from spark_sb.cli import main\n"
            "runs = {}\n"
            "for argv in (['emulator', 'start'], ['emulator', 'fault', '--admin', 'http://localhost:5300', 'down'],\n"
            "             ['emulator', 'heal', '--admin', 'http://localhost:5300']):\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err):\n"
            "        runs[' '.join(argv[:2])] = [main(argv), err.getvalue()]\n"
            "try:\n"
            "    from spark_sb.emulator import EmulatorProcess\n"
            "    imported = 'no error'\n"
            "except ImportError as err:\n"
            "    imported = str(err)\n"
            "print(json.dumps({'failed': failed, 'loaded': loaded, 'runs': runs, 'import': imported}))")
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["failed"] == {}
    assert report["loaded"] == [], "a module outside spark_sb.emulator imports it"
    for command, (status, stderr) in report["runs"].items():
        assert (status, stderr) == (2, EMULATOR_EXTRA + "\n"), command
    assert report["import"] == EMULATOR_EXTRA


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, at the top or inside functions (not under TYPE_CHECKING)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and ast.unparse(block.test).endswith("TYPE_CHECKING") for node in ast.walk(block)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_module_imports_one_that_imports_it_back() -> None:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    # the package's __init__ only re-exports, lazily: it is not a layer
    graph = {name: _imports(path, name, modules) - {"spark_sb"} for name, path in paths.items() if name != "spark_sb"}
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            cycles.append(" -> ".join([*stack[stack.index(node):], node]))
            return
        if node in done:
            return
        for child in sorted(graph.get(node, ())):
            visit(child, [*stack, node], done)
        done.add(node)

    finished: set[str] = set()
    for start in sorted(graph):
        visit(start, [], finished)
    assert cycles == []
