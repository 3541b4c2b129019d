"""Spark options of the ``servicebus`` formats (readers and writers): the configuration handed over by reference,
so that no secret is written into Spark's plan, progress or event log, and the options' own values."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .config import (
    SparkSbConfig,
    did_you_mean,
    from_options,
    is_literal_secret,
    load_config,
    load_reference,
    option_section,
)
from .errors import ConfigError

_LOGGER = logging.getLogger(__name__)

__all__ = ["SPARK_OPTIONS", "check_known", "config_options", "option", "options_config", "positive"]

#: options Spark itself puts among a data source's options: the path given to ``save``/``load`` (``paths``, a JSON
#: list, when ``load`` is given several) and a stream's checkpoint location. Spark hands them over lower-cased, as
#: every option (a case-insensitive dict)
SPARK_OPTIONS = ("path", "paths", "checkpointLocation")
#: what other connectors call the entity option
_ENTITY_ALIASES = frozenset({"queue", "topic", "queuename", "topicname", "entitypath", "entityname", "destination"})


def options_config(options: Mapping[str, str]) -> SparkSbConfig:
    """The configuration the options hand over by reference (see :func:`config_options`)."""
    path = option(options, "conf")
    if path is not None:
        return load_config(path)
    reference = option(options, "config")
    if reference is not None:
        return load_reference(reference)
    config = from_options(options)
    if config.reference() is None:
        secret = next((str(k) for k, v in options.items() if is_literal_secret(str(k).rsplit(".", 1)[-1], v)), "options")
        raise ConfigError(secret, "holds a literal secret, which Spark would write into its plan and event log: pass "
                          "the configuration by reference (option conf: a YAML path; or option config: JSON whose "
                          "secrets are ${ENV_VAR} references; spark_sb.options.config_options builds them)")
    return config


def check_known(options: Mapping[str, str], own: Iterable[str], what: str) -> None:
    """Refuse, naming it, an option ``what`` does not take (a misspelt one would otherwise be ignored): known
    are ``own``, ``conf``, ``config``, Spark's own (:data:`SPARK_OPTIONS`) and, without ``conf`` or ``config``,
    the flat configuration options (``primary.connectionString``, ``sink.keyColumn``...). Next to ``conf`` or
    ``config``, which hand over the whole configuration, a flat configuration option is refused too."""
    own = tuple(own)
    known = {name.lower() for name in (*own, "conf", "config", *SPARK_OPTIONS)}
    by_reference = option(options, "conf") is not None or option(options, "config") is not None
    for key in options:
        name = str(key)
        if name.lower() in known:
            continue
        if option_section(name) is not None:
            if by_reference:
                reference = "conf" if option(options, "conf") is not None else "config"
                raise ConfigError(name, f"is a configuration option next to option {reference}, which hands over the "
                                  "whole configuration: set it in that configuration"
                                  + (f", or use the {what}'s own options ({', '.join(own)})" if own else ""))
            continue
        hint = (" (did you mean entity?)" if "entity" in own and name.lower().replace("_", "") in _ENTITY_ALIASES
                else did_you_mean(name, (*own, "conf", "config")))
        raise ConfigError(name, f"is not an option of the {what}{hint}: it "
                          f"takes {', '.join((*own, 'conf', 'config'))} or flat configuration options such as "
                          "primary.connectionString")


def config_options(conf: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig) -> dict[str, str]:
    """The source options that hand ``conf`` to the readers by reference, so that no secret is written into
    Spark's plan, its progress reports or its event log:

    * ``conf``: a YAML path: the path given, or the file the configuration was loaded from;
    * else ``config``: the configuration as JSON, when every secret in it is a ``${ENV_VAR}`` reference
      (resolved where the reader runs: set the variable on the driver and the executors);
    * else (literal secrets, e.g. a dict built in code) ``conf``: a YAML file this process writes, readable by
      its user only and removed at exit. Executors must read it: this works on one machine (local mode); on a
      cluster give a path every node reads, or references.
    """
    if isinstance(conf, str | os.PathLike):
        return {"conf": str(Path(conf).resolve())}
    config = load_config(conf)
    if config.origin_path is not None:
        return {"conf": config.origin_path}
    reference = config.reference()
    if reference is not None:
        return {"config": json.dumps(reference)}
    return {"conf": _private_file(config)}


_PRIVATE_FILES: dict[str, str] = {}


def _private_file(config: SparkSbConfig) -> str:
    """A YAML file holding ``config`` with its secrets, readable by this user only, removed at exit."""
    import atexit
    import tempfile

    import yaml

    fingerprint = config.fingerprint()
    path = _PRIVATE_FILES.get(fingerprint)
    if path is None or not os.path.exists(path):
        handle, path = tempfile.mkstemp(prefix="spark-sb-", suffix=".yaml")  # mode 0600
        with os.fdopen(handle, "w") as out:
            yaml.safe_dump(config.to_dict(secrets=True), out)
        atexit.register(Path(path).unlink, missing_ok=True)
        _PRIVATE_FILES[fingerprint] = path
        _LOGGER.info("the configuration holds literal secrets: the source reads it from %s (this user only)", path)
    return path


def option(options: Mapping[str, str], name: str) -> str | None:
    for key, value in options.items():
        if str(key).lower() == name.lower() and value not in (None, ""):
            return str(value)
    return None


def positive(options: Mapping[str, str], name: str, default: float, kind: type = int, most: float | None = None
              ) -> Any:
    text = option(options, name)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(name, f"must be a positive {'integer' if kind is int else 'number'}", text) from None
    if value <= 0 or value != value:
        raise ConfigError(name, "must be positive", text)
    if most is not None and value > most:
        raise ConfigError(name, f"must be at most {most:g}", text)
    return value
