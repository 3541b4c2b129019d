"""The configuration of the test session's emulator pair, shared by the paired, Spark and syphon tests
(imported as ``pairing``: ``tests/`` is on ``sys.path`` through its conftest)."""

from __future__ import annotations

import itertools
import uuid
from typing import Any

_prefixes = itertools.count()


def pair_config(primary: Any, secondary: Any, tag: str, *, prefix: str | None = None,
                **send_availability: Any) -> dict:
    """``primary`` and ``secondary`` sections for the emulator pair, and a ``send_availability`` section with a
    backlog prefix unique to the call (``<tag><n>-<random>``, unless ``prefix``) and the given options."""
    return {
        "primary": {"connection_string": primary.connection_string, "admin_endpoint": primary.admin_url},
        "secondary": {"connection_string": secondary.connection_string, "admin_endpoint": secondary.admin_url},
        "send_availability": {"backlog_prefix": prefix or f"{tag}{next(_prefixes)}-{uuid.uuid4().hex[:8]}",
                              **send_availability},
    }
