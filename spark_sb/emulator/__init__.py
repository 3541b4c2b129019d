"""A local Azure Service Bus that the unmodified azure-servicebus SDK talks to.

Imports nothing from the rest of spark_sb but the leaf :mod:`spark_sb.durations`. Needs the ``[emulator]`` extra
(python-qpid-proton, cryptography, PyJWT, websockets); without it, importing this package (or any of its modules) raises
ModuleNotFoundError naming ``pip install 'spark-sb[emulator]'``.
"""

from __future__ import annotations

#: the top-level modules of the [emulator] extra: python-qpid-proton, cryptography, PyJWT, websockets
_EXTRA_MODULES = frozenset({"proton", "cproton", "_cproton", "cryptography", "jwt", "websockets"})

# isort: off
try:  # the modules that need the extra first: a core install then loads none of the emulator's
    from .amqp import FAULT_KINDS
    from .server import (
        DEFAULT_NAMESPACES,
        Emulator,
        EmulatorProcess,
        NamespaceInfo,
        NamespaceOptions,
        fault,
        heal,
    )
    from ._http_loop import AdminLimits  # after them, see above
except ModuleNotFoundError as err:  # a core install (a cluster) has no emulator: say which extra brings it
    if (err.name or "").partition(".")[0] not in _EXTRA_MODULES:
        raise
    raise ModuleNotFoundError(f"spark-sb emulator needs the emulator extra: pip install 'spark-sb[emulator]' ({err})",
                              name=err.name) from err
# isort: on

__all__ = [
    "AdminLimits",
    "DEFAULT_NAMESPACES",
    "Emulator",
    "EmulatorProcess",
    "FAULT_KINDS",
    "NamespaceInfo",
    "NamespaceOptions",
    "fault",
    "heal",
]
