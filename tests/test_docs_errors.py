"""The errors page (docs/errors.md) and the code agree: every exception class spark-sb defines that can reach a
user has an entry there (a heading named exactly as the class, so that it can be linked), and every heading on the
page names such a class. A new exception class without an entry fails here; so does an entry left behind by a class
that was renamed or removed.

The package's modules are imported (no Spark session is started) and every exception class defined in them is
collected; a module that cannot be imported because an optional package (an extra) is missing is read with
:mod:`ast` instead."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import spark_sb

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "errors.md"

#: exception classes that never reach a user, each with where it ends; everything else public is on the page
INTERNAL = {
    # send_batches' "some batches were accepted, then this failed": every caller (the paired and replicating
    # senders, dead_letters.resend) catches it and raises a spark-sb error or records the rejected rows
    "spark_sb.bus.batches.PartialSend",
    # a pipelined sender closed under a send: spark_sb.bus sends again on a new sender
    "spark_sb.bus.pipeline.SenderClosed",
    # not a duration: the configuration raises ConfigError naming the option, the CLI an argparse error, the
    # emulator an EntityConfigError or a 400
    "spark_sb.durations.DurationError",
    # the emulator's SAS token check: answered to the client as the service answers (401), never raised out of it
    "spark_sb.emulator.sas.SasError",
    # a message's filter and action budget spent in the emulator: that rule does not match that message (a WARNING
    # in the emulator's log), never raised out of it
    "spark_sb.emulator.sql.BudgetExceeded",
    # an AMQP message the emulator cannot decode: answered amqp:decode-error (or a BrokerError), never raised out
    "spark_sb.emulator.sections.MalformedMessage",
    # a request the emulator's live page refuses: answered to the browser as JSON with its status, never raised out
    "spark_sb.emulator.page.PageError",
}


def _module_names() -> list[str]:
    return [spark_sb.__name__] + [m.name for m in pkgutil.walk_packages(spark_sb.__path__, f"{spark_sb.__name__}.")]


def _unimportable_classes(modules: list[str], known: set[str]) -> dict[str, str]:
    """``{qualified name: class name}`` of the exception classes that modules which cannot be imported define,
    read from their source: classes whose bases name a builtin exception or an exception class found elsewhere
    (in these modules too, in any order)."""
    trees = {}
    for module in modules:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        trees[module] = ast.parse(Path(spec.origin).read_text())
    found: dict[str, str] = {}
    changed = True
    while changed:  # a class may derive from one defined further down, or in another of these modules
        changed = False
        for module, tree in trees.items():
            for node in tree.body:
                if not isinstance(node, ast.ClassDef) or f"{module}.{node.name}" in found:
                    continue
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                if bases & (known | set(found.values())):
                    found[f"{module}.{node.name}"] = node.name
                    changed = True
    return found


def exception_classes() -> dict[str, str]:
    """``{qualified name: class name}`` of every exception class defined in spark_sb (private ones included)."""
    classes: dict[str, str] = {}
    unimportable: list[str] = []
    for name in _module_names():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:  # an optional extra missing here: read the module's source instead
            assert err.name is not None and not err.name.startswith("spark_sb"), f"{name}: {err}"
            unimportable.append(name)
            continue
        for attr, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                classes[f"{name}.{attr}"] = attr
    known = {n for n, v in vars(builtins).items() if inspect.isclass(v) and issubclass(v, BaseException)}
    known |= set(classes.values())
    classes.update(_unimportable_classes(unimportable, known))
    return classes


def user_facing() -> dict[str, str]:
    """``{class name: qualified name}`` of the exception classes that must be on the page."""
    public = {qualified: name for qualified, name in exception_classes().items()
              if not name.startswith("_") and qualified not in INTERNAL}
    names = sorted(public.values())
    assert len(names) == len(set(names)), f"two public exception classes share a name: {names}"
    return {name: qualified for qualified, name in public.items()}


def page_headings(text: str) -> list[tuple[int, str]]:
    """``[(level, text)]`` of the Markdown headings outside fenced code blocks."""
    headings = []
    fenced = False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            continue
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match and not fenced:
            headings.append((len(match.group(1)), match.group(2)))
    return headings


def test_the_walk_finds_the_exception_classes_a_user_meets() -> None:
    """The collection itself works: it finds classes of spark_sb.errors, of other modules and of the emulator."""
    found = user_facing()
    for name in ("ConfigError", "PairingError", "SyphonSettleError", "ReceiveUnavailableError", "EntityConfigError"):
        assert name in found
    assert "PartialSend" not in found and "_BadMessage" not in found
    assert set(INTERNAL) <= set(exception_classes()), "INTERNAL names a class that no longer exists"


def test_a_module_that_cannot_be_imported_is_read_from_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the emulator extra (a cluster's install) the emulator's classes are still found, by their source."""
    imported = exception_classes()
    real_import = importlib.import_module

    def without_the_extra(name: str, package: str | None = None) -> object:
        if name.startswith("spark_sb.emulator."):
            raise ModuleNotFoundError("No module named 'proton'", name="proton")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", without_the_extra)
    read = exception_classes()
    emulator = {q: n for q, n in imported.items() if q.startswith("spark_sb.emulator.")}
    assert emulator and {q: n for q, n in read.items() if q.startswith("spark_sb.emulator.")} == emulator


def test_every_exception_class_a_user_can_meet_has_an_entry_on_the_errors_page() -> None:
    headings = {text for level, text in page_headings(PAGE.read_text()) if level >= 2}
    missing = {name: qualified for name, qualified in user_facing().items() if name not in headings}
    assert not missing, (f"exception classes without an entry on docs/errors.md: {missing}. Add a heading named as "
                         "the class (what it means, what happened to the data, what to do), or, if it never reaches "
                         "a user, add it to INTERNAL in this test with where it ends")


def test_every_heading_on_the_errors_page_names_an_exception_class() -> None:
    headings = page_headings(PAGE.read_text())
    assert [level for level, _ in headings].count(1) == 1 and headings[0][0] == 1, "one title, first"
    classes = user_facing()
    strays = [text for level, text in headings if level >= 2 and text not in classes]
    assert not strays, f"headings on docs/errors.md that name no user-facing exception class of spark_sb: {strays}"
    named = [text for level, text in headings if level >= 2]
    assert len(named) == len(set(named)), "a class has two entries"


def test_public_exceptions_of_spark_sb_are_named_by_their_import_path_on_the_page() -> None:
    """Each entry says where to import the class from, as ``spark_sb.X`` for the names of ``spark_sb.__all__``."""
    text = PAGE.read_text()
    for name in spark_sb.__all__:
        value = getattr(spark_sb, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            assert f"`spark_sb.{name}`" in text, name
