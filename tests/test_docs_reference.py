"""The API reference and the configuration page of the manual cover the code: every public name of ``spark_sb``
has an entry in docs/reference/api.md generated from its docstring (at the module that defines it), and every
option of the configuration model is on docs/reference/configuration.md with a description of its own. (``make
docs`` builds the pages in strict mode: an entry naming something that does not exist fails there.)"""

from __future__ import annotations

import ast
import importlib
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

import spark_sb
from spark_sb import config

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "reference" / "api.md"
CONFIGURATION = ROOT / "docs" / "reference" / "configuration.md"
#: models behind an option that the user writes as one string, not as a section of options
WRITTEN_AS_TEXT = {"ConnectionString"}  # connection_string: the SDK's connection string, parsed


def directives(text: str) -> dict[str, str]:
    """``{identifier: the options block below it}`` of the page's mkdocstrings entries (``::: module.Name``)."""
    found = {}
    for match in re.finditer(r"^::: ([\w.]+)\n((?:[ \t]+.*\n|\n(?=[ \t]))*)", text + "\n", re.MULTILINE):
        found[match.group(1)] = match.group(2)
    return found


def resolve(identifier: str) -> object:
    module, _, name = identifier.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_public_name_of_spark_sb_has_an_entry_in_the_api_reference() -> None:
    text = API.read_text()
    entries = directives(text)
    for name in spark_sb.__all__:
        if name == "__version__":
            assert "`spark_sb.__version__`" in text
            continue
        at = [identifier for identifier in entries if identifier.rpartition(".")[2] == name]
        assert at, f"spark_sb.{name} has no '::: module.{name}' entry in docs/reference/api.md"
        assert resolve(at[0]) is getattr(spark_sb, name), f"{at[0]} is not spark_sb.{name}"


def _models() -> list[type[BaseModel]]:
    """The configuration's models, from SparkSbConfig down through its fields' types."""
    seen: list[type[BaseModel]] = []
    stack: list[type[BaseModel]] = [config.SparkSbConfig]
    while stack:
        model = stack.pop(0)
        if model in seen or model.__name__ in WRITTEN_AS_TEXT:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            for kind in _types(field.annotation):
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    stack.append(kind)
    return seen


def _types(annotation: object) -> list[object]:
    args = typing.get_args(annotation)
    return [annotation] if not args else [t for arg in args for t in _types(arg)]


def _documented_fields(model: type[BaseModel]) -> set[str]:
    """The fields of ``model`` followed by a docstring in spark_sb/config.py."""
    tree = ast.parse(Path(config.__file__).read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == model.__name__]
    documented = set()
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
                and after.value.value.strip()):
            documented.add(stmt.target.id)
    return documented


def test_every_option_of_the_configuration_is_on_the_configuration_page_with_its_meaning() -> None:
    entries = directives(CONFIGURATION.read_text())
    models = _models()
    assert {m.__name__ for m in models} >= {"SparkSbConfig", "NamespaceConfig", "CredentialConfig", "SinkConfig",
                                            "SinkSourceConfig", "SendAvailabilityConfig", "SyphonConfig"}
    for model in models:
        identifier = f"spark_sb.config.{model.__name__}"
        assert identifier in entries, f"{model.__name__} has no entry on docs/reference/configuration.md"
        listed = re.findall(r"^ +- (\w+)$", entries[identifier], re.MULTILINE)
        assert sorted(listed) == sorted(model.model_fields), (
            f"{model.__name__}: the page lists {listed}, the model has {list(model.model_fields)}")
        undocumented = set(model.model_fields) - _documented_fields(model)
        assert not undocumented, f"{model.__name__}: options without a docstring saying what they mean: {undocumented}"


def test_the_configuration_page_s_example_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The YAML block of docs/reference/configuration.md is a configuration load_config takes, as written."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", CONFIGURATION.read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1
    for name, port in (("SB_PRIMARY", 5672), ("SB_SECONDARY", 5673)):
        monkeypatch.setenv(name, f"Endpoint=sb://localhost:{port};SharedAccessKeyName=RootManageSharedAccessKey;"
                                 "SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true")
    loaded = config.load_config(yaml.safe_load(blocks[0]))
    assert loaded.secondary.fully_qualified_namespace == "localhost:5673"
    assert loaded.send_availability.failover_interval.total_seconds() == 60
    assert (loaded.sink.entity, loaded.syphon.ledger) == ("orders", "/delta/syphon_ledger")
