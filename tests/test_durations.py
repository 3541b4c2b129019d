"""spark_sb.durations: the one duration parser and its formatters (configuration and emulator)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from spark_sb.durations import (
    DurationError,
    duration_text,
    format_duration,
    iso_duration,
    parse_duration,
    parse_seconds,
)


@pytest.mark.parametrize("value", [timedelta(0), timedelta(milliseconds=800), timedelta(seconds=90),
                                   timedelta(minutes=60), timedelta(hours=25), timedelta(microseconds=500)])
def test_every_text_parses_back(value: timedelta) -> None:
    assert parse_duration(duration_text(value)) == value
    assert parse_duration(iso_duration(value)) == value


@pytest.mark.parametrize(("text", "seconds"), [("P1W", 604800.0), ("pt1m", 60.0), ("PT1H30M", 5400.0), ("1d", 86400.0),
                                               (" 1h 30m ", 5400.0), ("60 sec", 60.0), ("-5", -5.0),
                                               # Spark's interval words, as withWatermark takes them
                                               ("10 minutes", 600.0), ("1 hour", 3600.0), ("500 milliseconds", 0.5),
                                               ("2 hours 5 minutes", 7500.0), ("1 week", 604800.0), ("500ms", 0.5)])
def test_spellings(text: str, seconds: float) -> None:
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("value", ["soon", "", "P", "PT", "P1DT", "5 parsecs", "10 minutesx", True, None, float("inf"), [1]])
def test_what_is_not_a_duration(value: object) -> None:
    with pytest.raises(DurationError) as caught:
        parse_duration(value)
    assert caught.value.problem.startswith("not a duration") and caught.value.value == repr(value)


def test_iso_only_refuses_the_other_spellings() -> None:
    assert parse_seconds("PT30.5S", iso_only=True) == 30.5
    for text in ("30s", "30", 30):
        with pytest.raises(DurationError):
            parse_seconds(text, iso_only=True)


def test_formats() -> None:
    assert [format_duration(timedelta(seconds=s)) for s in (7200, 3600, 90, 1.5, 0.5, 0)] == [
        "2 h", "60 min", "90 s", "1.5 s", "500 ms", "0 s"]
    assert [iso_duration(s) for s in (60.0, 30.5, 93600.0, 0.0)] == ["PT1M", "PT30.5S", "P1DT2H", "PT0S"]


def test_the_syphon_job_takes_its_timeout_as_a_duration_like_every_other_option(tmp_path) -> None:
    """``spark-sb-syphon --timeout`` took only a number of seconds while every other duration takes ``5m``; a bad
    one is refused by name before anything starts (exit 2). (A missing configuration stops it before Spark.)"""
    import subprocess
    import sys

    def syphon(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", "import sys; from spark_sb.jobs import syphon_main; "
                               "sys.exit(syphon_main(sys.argv[1:]))", "--conf", str(tmp_path / "missing.yaml"), *args],
                              capture_output=True, text=True, timeout=120)

    for accepted in ("2m", "90s", "45", "0"):
        ran = syphon("--until-empty", "--timeout", accepted)
        assert ran.returncode == 2 and "cannot read the configuration file" in ran.stderr, (accepted, ran.stderr)
    refused = syphon("--until-empty", "--timeout", "5x")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith("spark-sb-syphon: error: argument --timeout: not a "
                                                              "duration"), refused.stderr
    assert "got '-1s'" in syphon("--timeout=-1s").stderr
