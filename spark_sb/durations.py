"""Durations: one parser and the formatters, shared by the configuration and the emulator.

A leaf module: it imports nothing from spark_sb, so the emulator may use it.

Accepted spellings (:func:`parse_seconds`): a number of seconds (``90``, ``1.5``, ``"90"``), units
(``500ms``, ``60s``, ``60 sec``, ``5m``, ``2 min``, ``1h``, ``2d``, combined: ``1h30m``; or the words Spark's
intervals use: ``10 minutes``, ``1 hour``, ``30 seconds``, ``500 milliseconds``, ``2 days``), ISO 8601
(``PT1M``, ``PT0.5S``, ``P1DT1H``, ``P1W``; case-insensitive), or a :class:`~datetime.timedelta`.

* :func:`format_duration`: as people read it in an error (``2 h``, ``60 min``, ``1.5 s``, ``500 ms``);
* :func:`duration_text`: as a configuration value that parses back exactly (``1m``, ``800ms``);
* :func:`iso_duration`: ISO 8601 as .NET writes a TimeSpan (``PT1M``, ``P1DT2H``, ``PT0.5S``);
* :data:`Duration`: the pydantic field type (a ``timedelta`` parsed with :func:`parse_duration`, written
  back with :func:`duration_text`); pydantic is imported only when it is first used.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated, Any

__all__ = [
    "Duration",
    "DurationError",
    "duration_text",
    "format_duration",
    "iso_duration",
    "parse_duration",
    "parse_seconds",
]

DURATION_HELP = "not a duration (write 500ms, 60s, 5m, 1h, 1h30m, a number of seconds, or ISO 8601 such as PT1M)"

_UNIT_SECONDS = {"ms": 0.001, "millisecond": 0.001, "s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0,
                 "minute": 60.0, "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0, "week": 604800.0}
_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(milliseconds?|seconds?|minutes?|hours?|days?|weeks?|ms|sec|min|s|m|h|d)"
                   r"(?![a-z])", re.IGNORECASE)
_NUMBER = re.compile(r"^[+-]?\d+(?:\.\d+)?$")
_N = r"(\d+(?:\.\d+)?)"
_ISO = re.compile(rf"^P(?:{_N}W)?(?:{_N}D)?(?:T(?:{_N}H)?(?:{_N}M)?(?:{_N}S)?)?$", re.IGNORECASE)
_ISO_SECONDS = (604800.0, 86400.0, 3600.0, 60.0, 1.0)


def _unit_seconds(unit: str) -> float:
    unit = unit.lower()
    return _UNIT_SECONDS[unit[:-1] if len(unit) > 3 and unit.endswith("s") else unit]  # minutes -> minute


class DurationError(ValueError):
    """Not a duration. ``problem`` says what is accepted, ``value`` is the input as ``repr`` shows it."""

    def __init__(self, value: object, problem: str = DURATION_HELP) -> None:
        super().__init__(f"{problem}, got {value!r}")
        self.problem = problem
        self.value = repr(value)


def parse_seconds(value: object, *, iso_only: bool = False) -> float:
    """Seconds from any accepted spelling (only ISO 8601 when ``iso_only``); :class:`DurationError` if not."""
    if isinstance(value, timedelta) and not iso_only:
        return value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool) and not iso_only:
        if math.isfinite(value):
            return float(value)
        raise DurationError(value)
    if not isinstance(value, str):
        raise DurationError(value)
    text = value.strip()
    iso = _ISO.match(text)
    if iso and any(iso.groups()) and not text.upper().endswith("T"):
        return sum(float(part) * size for part, size in zip(iso.groups(), _ISO_SECONDS, strict=True) if part)
    if iso_only:
        raise DurationError(value)
    if _NUMBER.match(text):
        return float(text)
    total, position = 0.0, 0
    for match in _PART.finditer(text):
        if match.start() != position:
            break
        total += float(match.group(1)) * _unit_seconds(match.group(2))
        position = match.end()
    if position == 0 or text[position:].strip():
        raise DurationError(value)
    return total


def seconds_argument(text: str) -> float:
    """A positive duration (``60s``, ``2m``, ``PT1M``, or a number of seconds) as seconds: an ``argparse`` type, as
    every command's duration options take them."""
    import argparse

    try:
        seconds = parse_seconds(text)
    except DurationError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a positive duration, got {text!r}")
    return seconds


def timeout_argument(text: str) -> float:
    """:func:`seconds_argument` where 0 (``0``, ``0s``) means "no bound"."""
    return 0.0 if text.strip() in ("0", "0s") else seconds_argument(text)


def parse_duration(value: object) -> timedelta:
    """A :class:`~datetime.timedelta` from any accepted spelling; :class:`DurationError` if not."""
    if isinstance(value, timedelta):
        return value
    try:
        return timedelta(seconds=parse_seconds(value))
    except OverflowError:
        raise DurationError(value) from None


def _micros(value: timedelta | float) -> int:
    if isinstance(value, timedelta):
        return round(value / timedelta(microseconds=1))
    return round(value * 1_000_000)


def format_duration(value: timedelta | float) -> str:
    """As people write it in errors: ``2 h``, ``60 min``, ``90 s``, ``1.5 s``, ``500 ms``."""
    micros = _micros(value)
    if micros == 0:
        return "0 s"
    sign = "-" if micros < 0 else ""
    micros = abs(micros)
    if micros % 3_600_000_000 == 0 and micros >= 7_200_000_000:  # 60 min stays "60 min", 2 h is "2 h"
        return f"{sign}{micros // 3_600_000_000} h"
    for unit, size in (("min", 60_000_000), ("s", 1_000_000)):
        if micros % size == 0:
            return f"{sign}{micros // size} {unit}"
    if micros >= 1_000_000:
        return f"{sign}{micros / 1_000_000:g} s"
    return f"{sign}{micros / 1000:g} ms"


def duration_text(value: timedelta | float) -> str:
    """As a configuration value that parses back exactly: ``1m``, ``800ms``, ``0.0005``."""
    micros = _micros(value)
    for unit, size in (("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000), ("ms", 1_000)):
        if micros % size == 0:
            return f"{micros // size}{unit}"
    return f"{micros / 1_000_000}"


def iso_duration(value: timedelta | float) -> str:
    """ISO 8601 as .NET writes a TimeSpan: ``PT1M``, ``P1DT2H``, ``PT0.5S``, ``PT0S`` (negatives as 0)."""
    micros = max(0, _micros(value))
    days, rest = divmod(micros, 86_400_000_000)
    hours, rest = divmod(rest, 3_600_000_000)
    minutes, rest = divmod(rest, 60_000_000)
    secs, frac = divmod(rest, 1_000_000)
    clock = (f"{hours}H" if hours else "") + (f"{minutes}M" if minutes else "")
    if secs or frac:
        clock += f"{secs}.{frac:06d}".rstrip("0").rstrip(".") + "S"
    out = "P" + (f"{days}D" if days else "") + (f"T{clock}" if clock else "")
    return out if out != "P" else "PT0S"


if TYPE_CHECKING:
    from pydantic import BeforeValidator, PlainSerializer

    #: the configuration's duration field type: parsed by :func:`parse_duration`, dumped by :func:`duration_text`
    Duration = Annotated[timedelta, BeforeValidator(parse_duration), PlainSerializer(duration_text, return_type=str)]


def __getattr__(name: str) -> Any:
    # Duration is built on first use, so that the emulator (which uses only the functions) never imports pydantic
    if name == "Duration":
        from pydantic import BeforeValidator, PlainSerializer

        duration = Annotated[timedelta, BeforeValidator(parse_duration), PlainSerializer(duration_text, return_type=str)]
        globals()["Duration"] = duration
        return duration
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
