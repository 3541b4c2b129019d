"""The option tables of the ``servicebus`` format (docs/reading.md and docs/writer.md, section Options) hold every
option the source and the writer take, nothing else, and the defaults the code gives: a new option cannot go
undocumented, and a removed one cannot stay in the manual.

The options are read from the code without importing it (no Spark): every option name the source's and the
writer's modules read through ``spark_sb.options`` (``option``, ``positive``, the source's ``_sequence_option``),
the names they declare to ``check_known``, and ``conf`` and ``config``, which ``options_config`` reads for both."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spark_sb"
#: the functions that read one option, its name as their second argument (spark_sb.options, spark_sb.source)
_READERS = {"option", "_option", "positive", "_positive", "_sequence_option"}
#: what options_config reads for every servicebus format: the configuration by reference or by value
_CONFIGURATION = {"conf", "config"}


def _constants(*modules: ast.Module) -> dict[str, Any]:
    """Module-level ``NAME = <literal>`` assignments (numbers, strings, tuples of them)."""
    found: dict[str, Any] = {}
    for module in modules:
        for node in module.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
                node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
                try:
                    found[target.id] = ast.literal_eval(node.value)  # type: ignore[arg-type]
                except ValueError:
                    pass
    return found


def _value(node: ast.AST, constants: dict[str, Any]) -> Any:
    """A literal, a module constant, or the last resolvable value of ``a or b``; None when unknown."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.BoolOp):
        return next((v for v in (_value(n, constants) for n in reversed(node.values)) if v is not None), None)
    if isinstance(node, ast.Tuple | ast.List):
        return tuple(_value(n, constants) for n in node.elts)
    return None


def code_options(module: str) -> dict[str, Any]:
    """``{option: default or None}`` of what ``spark_sb/<module>.py`` reads or declares."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    constants = _constants(tree, ast.parse((PACKAGE / "options.py").read_text()))
    found: dict[str, Any] = dict.fromkeys(_CONFIGURATION)
    plain: set[str] = set()  # read without a default too: the default given to positive() is not the option's
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else \
            node.func.attr if isinstance(node.func, ast.Attribute) else ""
        if name in _READERS:
            option = _value(node.args[1], constants)
            if isinstance(option, str):
                default = _value(node.args[2], constants) if len(node.args) > 2 and "positive" in name else None
                found[option] = found.get(option) if default is None else default
                if "positive" not in name:
                    plain.add(option)
        elif name in ("check_known", "_check_known"):
            declared = _value(node.args[1], constants)  # a literal tuple or a module constant; else the reads
            for option in declared if isinstance(declared, tuple) else ():
                if isinstance(option, str):
                    found.setdefault(option, None)
    return {option: None if option in plain else default for option, default in found.items()}


def doc_options(page: str) -> dict[str, str]:
    """``{option: its Default cell}`` of the table in ``docs/<page>``'s section Options."""
    text = (ROOT / "docs" / page).read_text()
    section = re.search(r"^## Options\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"docs/{page} has no section '## Options'"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header[:2] == ["Option", "Default"] and header[-1] == "Meaning", header
    table: dict[str, str] = {}
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == len(header), f"docs/{page}: a row of {len(cells)} cells: {row}"
        option = re.fullmatch(r"`([A-Za-z]+)`", cells[0])
        assert option, f"docs/{page}: the first cell names one option in backticks: {row}"
        assert option.group(1) not in table, f"docs/{page}: {option.group(1)} twice"
        assert cells[-1], f"docs/{page}: {option.group(1)} has no meaning"
        table[option.group(1)] = cells[1]
    return table


@pytest.mark.parametrize(("page", "module"), [("reading.md", "source"), ("writer.md", "writer")])
def test_the_option_table_lists_every_option_the_code_takes_with_its_default(page: str, module: str) -> None:
    code, documented = code_options(module), doc_options(page)
    assert set(documented) == set(code), (
        f"docs/{page}'s option table: undocumented {sorted(set(code) - set(documented))}, not taken by "
        f"spark_sb/{module}.py {sorted(set(documented) - set(code))}")
    for option, default in code.items():
        if isinstance(default, int | float) and not isinstance(default, bool):
            assert re.search(rf"(?<![\d.]){re.escape(f'{default:g}')}(?![\d.])", documented[option]), (
                f"docs/{page}: {option}'s default is {default:g} in spark_sb/{module}.py, "
                f"{documented[option]!r} in the table")


def test_the_check_reads_the_options_as_the_code_reads_them() -> None:
    """The scan finds what the code does: the source's stream, batch and shared options with their defaults, and
    the writer's two own options."""
    source = code_options("source")
    assert {"entity", "namespaces", "maxMessagesPerTrigger", "readRetryTimeout", "fromSequenceNumber"} <= set(source)
    assert source["readRetryTimeout"] == 120.0 and source["receiveTimeout"] == 1.0
    assert source["receivesInFlight"] == 8  # default_lanes or RECEIVES_IN_FLIGHT
    assert source["maxMessages"] is None  # read as given first: positive()'s 1 is no default
    # the servicebus source's maxMessagesPerTrigger default is a constant handed to the shared reader
    default = _constants(ast.parse((PACKAGE / "source.py").read_text()))["DEFAULT_MAX_PER_TRIGGER"]
    assert doc_options("reading.md")["maxMessagesPerTrigger"] == str(default)
    assert code_options("writer") == {"conf": None, "config": None, "entity": None, "keyColumn": None}
