"""A Spark Python process of ours ends when the process that started it dies.

Spark starts a streaming data source's reader in a process of its own, ``python -m
pyspark.sql.streaming.python_streaming_source_runner``, a plain child of the JVM (not forked by ``pyspark.daemon``)
in the JVM's process group. That process reads Spark's socket only between two calls: while the reader is busy in
``latestOffset`` (receiving and deferring a batch, which can take minutes) it does not see that the JVM died. So a
job whose driver or JVM was killed (SIGKILL of the driver's Python: the JVM exits when its stdin closes; SIGKILL of
the JVM itself: spark-submit, the OOM killer) left that process running as an orphan, receiving, deferring and
holding message locks, until its call returned. Killing the job's whole process group does kill it.

Executors' Python workers need no such watch: they are forked by ``pyspark.daemon``, which reads its stdin from the
JVM and, when it closes, sends SIGHUP to its own process group, where they are (their SIGHUP action is the default,
so they die even while busy). Spark's planner workers (``pyspark.sql.worker.*``) are forked by such daemons too.

:func:`watch_parent` starts, once per process, a daemon thread that looks at the process's parent every second and
ends the process at once (``os._exit``, after one log line) when the parent changed: the parent died and the process
was re-parented (to pid 1 or a subreaper). It compares with the parent at start, not with pid 1, so a process whose
parent legitimately is pid 1 (a JVM that is a container's init) is left alone. It only watches in a process that
Spark started as a Python worker (``PYTHON_WORKER_FACTORY_SECRET`` in its environment, set by Spark's
``PythonWorkerFactory`` for every Python worker it starts): never in a user's own interpreter that builds a reader
itself (a test, a notebook), whose parent is none of Spark's business.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["watch_parent"]

_LOGGER = logging.getLogger(__name__)

#: set by Spark's PythonWorkerFactory in the environment of every Python worker it starts (simple or daemon)
SPARK_WORKER_MARK = "PYTHON_WORKER_FACTORY_SECRET"
#: the exit status of a process ended because its parent died (nobody reads it: its new parent reaps it)
EXIT_STATUS = 1

_LOCK = threading.Lock()
_watching_pid: int | None = None  # the process whose watch is running (a forked child starts its own)


def watch_parent(interval: float = 1.0) -> bool:
    """Watch this process's parent (idempotent): when it dies, end this process within about ``interval``
    seconds. Only in a Python worker that Spark started; returns whether this process is watched."""
    global _watching_pid
    if SPARK_WORKER_MARK not in os.environ:
        return False
    with _LOCK:
        if _watching_pid == os.getpid():
            return True
        parent = os.getppid()
        threading.Thread(target=_watch, args=(parent, interval), name="spark-sb-lifeline", daemon=True).start()
        _watching_pid = os.getpid()
    return True


def _watch(parent: int, interval: float, *, getppid: Callable[[], int] = os.getppid,
           sleep: Callable[[float], None] = time.sleep, exit: Callable[[int], object] = os._exit) -> None:
    """Return (after ending the process through ``exit``) once ``getppid()`` is no longer ``parent``."""
    while getppid() == parent:
        sleep(interval)
    try:
        _LOGGER.error("spark-sb: this Spark Python process (pid %d) lost its parent (pid %d, now %d): the driver or "
                      "its JVM died; exiting now", os.getpid(), parent, getppid())
    except Exception:  # noqa: S110 - a log that cannot be written (its pipe's reader died) never stops the exit
        pass
    exit(EXIT_STATUS)
