"""The two Spark jobs: the paired writer and the syphon, as functions.

Entry points (``pyproject.toml``): ``spark-sb-writer`` (:func:`writer_main`) and ``spark-sb-syphon``
(:func:`syphon_main`), which a Databricks ``python_wheel_task`` calls; ``jobs/paired_writer.py`` and
``jobs/syphon.py`` are thin ``spark-submit`` wrappers over the same functions.

The paired writer reads ``sink.source`` (the rate source by default: each rate row becomes the body
``row <value>`` with the key ``<timestamp ms>-<value>``, which is the message id: the same when a batch is
replayed, never the same in another run, even one without a checkpoint), and runs
``writeStream.foreachBatch(PairedSink)`` with ``sink.checkpoint_location`` and the ``sink.trigger`` trigger.

The syphon runs ``spark.readStream.format("servicebus-backlog") -> foreachBatch(Republisher)`` with
``syphon.checkpoint_location`` and the Delta ledger ``syphon.ledger`` (a path or a table name): one row per
moved, dead-lettered or re-parked message. A batch's backlog messages are settled only once the ledger records
their outcomes, so the query can be killed at any point and restarted from its checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .capabilities import (
    check_delta_pairing,
    delta_package,
    require_python_data_sources,
    spark_version,
    trigger_available_now,
)
from .config import load_config
from .durations import timeout_argument
from .errors import ConfigError, SparkSbError, UnsupportedSparkError

_LOGGER = logging.getLogger(__name__)

_NEEDS_SPARK = "needs pyspark and delta-spark: pip install 'spark-sb[spark]'"


# --- the Spark session ------------------------------------------------------------------------------------

def jvm_log_path(app_name: str) -> Path:
    """Where a local session's JVM writes its console output (Spark's log lines, the first run's jar download):
    ``$SPARK_SB_JVM_LOG`` when set, else ``<temp dir>/spark-sb/<app name>.log``."""
    configured = os.environ.get("SPARK_SB_JVM_LOG")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "spark-sb" / f"{app_name}.log"


def _delta_jars_cached() -> bool:
    """Whether Delta's jar is already in Spark's default Ivy cache (``~/.ivy2.5.2`` since Spark 4, ``~/.ivy2``
    before)."""
    group, artifact, version = delta_package().split(":")
    return any(any((home / "jars").glob(f"{group}_{artifact.split('_')[0]}*-{version}.jar"))
               for home in Path.home().glob(".ivy2*"))


def starting_line(app_name: str, jvm_log: Path | None = None) -> str:
    """What :func:`build_session` is about to do for a local session, in one line: where Spark's console output
    goes, and whether Delta Lake's jars are fetched from Maven Central first (once per machine)."""
    log = jvm_log or jvm_log_path(app_name)
    fetch = "" if _delta_jars_cached() else f"fetching Delta Lake's jars ({delta_package()}) from Maven Central, once; "
    return f"starting Spark ({app_name}): {fetch}its console output goes to {log}"


@contextlib.contextmanager
def _console_to(log: Path) -> Iterator[None]:
    """Point this process's stdout and stderr file descriptors at ``log`` while the JVM starts, so the JVM
    (and the Python workers it starts later) writes its console there for its whole life; this process's own
    output is restored at once."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "ab") as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def build_session(app_name: str = "spark-sb", master: str | None = None, *, jvm_log: Path | None = None) -> Any:
    """The active session, else a new one: as is on Databricks (Delta built in) and under ``spark-submit``
    (pass ``--packages`` :func:`~spark_sb.capabilities.delta_package`, e.g. ``io.delta:delta-spark_2.13:4.4.0``
    for Spark 4.2: the JVM is already running), else a local session (``local[2]``, or ``master`` /
    ``$SPARK_MASTER``) with Delta configured through ``configure_spark_with_delta_pip``. A delta-spark built for
    another Spark than the installed one is refused at once, naming both. A session this function starts writes the JVM's console output to
    :func:`jvm_log_path` (or ``jvm_log``) and logs one line saying so, and one more when Delta's jars are
    fetched from Maven Central (the first run on a machine)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName(app_name)
    if "DATABRICKS_RUNTIME_VERSION" in os.environ:  # Delta is built in there
        return builder.getOrCreate()
    from delta import configure_spark_with_delta_pip

    check_delta_pairing()
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    if master or not under_submit:  # a local session
        builder = builder.master(master or os.environ.get("SPARK_MASTER", "local[2]"))
        if (master or os.environ.get("SPARK_MASTER", "local")).startswith("local"):
            # a local session talks to itself over loopback (Spark would take the host's address otherwise)
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            # Delta rebuilds a table's state on first read over 50 partitions by default: seconds per small
            # table (the ledger, the metrics) on a laptop
            builder = builder.config("spark.databricks.delta.snapshotPartitions", "2")
    builder = (builder.config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
               .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2"))
    builder = configure_spark_with_delta_pip(builder)
    if under_submit:
        return builder.getOrCreate()
    log = jvm_log or jvm_log_path(app_name)
    _LOGGER.info("%s", starting_line(app_name, log))
    with _console_to(log):
        return builder.getOrCreate()


def require_spark(prog: str, *also: str) -> None:
    """Exit with a clear message (status 2) naming the ``[spark]`` extra when pyspark, delta-spark or one of
    the modules ``also`` (e.g. ``matplotlib``) is not installed."""
    for module in ("pyspark", "delta", *also):
        try:
            importlib.import_module(module)
        except ImportError as err:
            print(f"{prog} {_NEEDS_SPARK} ({err})", file=sys.stderr)
            raise SystemExit(2) from None


# --- the paired writer -----------------------------------------------------------------------------------

def read_source(spark: Any, config: Any) -> Any:
    """The streaming DataFrame of ``sink.source``; rate rows are mapped to ``body`` and ``key``."""
    from pyspark.sql import functions as F

    source = config.sink.source
    if source.kind == "table":
        return spark.readStream.options(**source.options).table(source.table)
    if source.kind == "path":
        reader = spark.readStream.format(source.format).options(**source.options)
        return reader.load(source.path)
    reader = spark.readStream.format("rate").option("rowsPerSecond", source.rows_per_second)
    if source.num_partitions is not None:
        reader = reader.option("numPartitions", source.num_partitions)
    rows = reader.options(**source.options).load()
    # the key (the message id) is ``<row timestamp in ms>-<value>``: the rate source counts from 0 again in
    # every new checkpoint, but its timestamps start at the checkpoint's creation time (kept in the checkpoint),
    # so a replayed batch gets the same ids and a new run never reuses an earlier run's
    key = F.concat_ws("-", F.unix_millis(F.col("timestamp")).cast("string"), F.col("value").cast("string"))
    return rows.select(F.concat(F.lit("row "), F.col("value").cast("string")).alias("body"), key.alias("key"))


def start_writer(spark: Any, conf: Any, foreach_batch: Callable[[Any, int], Any] | None = None,
                 checkpoint: str | None = None) -> tuple[Any, Any]:
    """Start the paired writer's query; returns ``(query, sink)``. ``foreach_batch`` wraps the sink when given
    (the demo uses it to print each batch's summary)."""
    from .sink import PairedSink

    config = load_config(conf)
    if config.sink.source.kind == "rate" and config.sink.key_column is None and "message_id" not in config.sink.columns:
        config = load_config({**config.to_dict(secrets=True),
                              "sink": {**config.sink.to_dict(), "key_column": "key"}})
    sink = PairedSink.from_config(config)
    location = checkpoint or config.sink.checkpoint_location
    if location is None:
        location = tempfile.mkdtemp(prefix="spark-sb-checkpoint-")
        _LOGGER.warning("sink.checkpoint_location is not set; using %s (a fresh one each run)", location)
    gate = _gated(foreach_batch or sink)
    writer = read_source(spark, config).writeStream.foreachBatch(gate)
    writer = writer.option("checkpointLocation", location).queryName("spark-sb-paired-writer")
    if config.sink.trigger is not None:
        writer = writer.trigger(processingTime=f"{config.sink.trigger.total_seconds()} seconds")
    return _started(writer.start(), gate), sink


class BatchGate:
    """A query's ``foreachBatch`` function behind a gate, so that the query can be stopped between two batches.

    Spark has no "stop after this batch": ``query.stop()`` interrupts the batch in flight, and a trigger can
    start between any check of ``isTriggerActive`` and the stop. An interrupted syphon batch has re-parked or
    moved some of its messages without completing them (the next run moves them again: duplicates), and an
    interrupted Python batch makes Spark's stream thread die of a StackOverflowError while it matches the long
    error text. :meth:`close` waits for the batch in flight (bounded) and refuses every batch after it: a
    refused batch raises :class:`StoppedBetweenBatches` before it does anything, so it is not committed and the
    next run on the checkpoint replays it. :func:`stop_between_batches` closes the gate of a query this module
    started, stops it and awaits its end. The gate lives in the driver's Python process (classic Spark, where
    ``foreachBatch`` runs there); on Spark Connect, where the function is pickled to the server, the copy has an
    open gate of its own and the stop is Spark's."""

    def __init__(self, fn: Callable[[Any, int], Any]) -> None:
        self._fn = fn
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False
        #: the batch ids refused after :meth:`close` (replayed by the next run)
        self.refused: list[int] = []
        #: the last batch whose function returned (Spark commits it next)
        self.last: int | None = None
        #: how many batches' function returned: the batches of this run (:func:`await_batches`)
        self.ran = 0
        #: refuse every batch once this many ran (:func:`await_batches` sets it; None: no limit)
        self.limit: int | None = None

    def __call__(self, df: Any, batch_id: int) -> Any:
        with self._cond:
            if self._closed or (self.limit is not None and self.ran >= self.limit):
                self.refused.append(batch_id)
                raise StoppedBetweenBatches(f"batch {batch_id} not run: the query is stopping (the next run on "
                                            "this checkpoint replays it)")
            self._running += 1
        ok = False
        try:
            result = self._fn(df, batch_id)
            ok = True
        finally:
            with self._cond:  # counted before the next batch can look (it checks ``ran`` under the lock)
                if ok:
                    self.last = batch_id
                    self.ran += 1
                self._running -= 1
                self._cond.notify_all()
        return result

    def close(self, settle: float) -> bool:
        """Refuse every batch from now on and wait up to ``settle`` seconds for the one in flight; whether no batch
        is running now."""
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: self._running == 0, settle)

    def __getstate__(self) -> dict[str, Any]:  # Spark Connect pickles the function: the copy's gate is open
        return {"fn": self._fn}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fn"])  # type: ignore[misc]


class StoppedBetweenBatches(RuntimeError):
    """Raised by a :class:`BatchGate` for a batch that started while its query was being stopped: the batch did
    nothing, and the next run on the checkpoint replays it."""


#: the gates of the queries this module started, by query id (:func:`stop_between_batches`)
_GATES: dict[str, BatchGate] = {}


def _gated(fn: Callable[[Any, int], Any]) -> BatchGate:
    return fn if isinstance(fn, BatchGate) else BatchGate(fn)


def _started(query: Any, gate: BatchGate) -> Any:
    _GATES[str(query.id)] = gate
    return query


def stop_between_batches(query: Any, settle: float = 30.0) -> None:
    """Stop ``query`` between two batches and await its end: a query :func:`start_writer` or :func:`start_syphon`
    started closes its :class:`BatchGate` (the batch in flight finishes, up to ``settle`` seconds; a batch that
    starts after is refused before it does anything); another query is stopped once no trigger is active (up to
    ``settle`` seconds). Raises the query's error (``StreamingQueryException``) when it failed, not for a batch
    the gate refused."""
    gate = _GATES.pop(str(query.id), None)
    deadline = time.monotonic() + settle
    if gate is not None:
        if not gate.close(settle):
            _LOGGER.warning("the batch in flight did not end within %g s: stopping the query interrupts it (the "
                            "next run on the checkpoint replays it)", settle)
        # the batch that ran last is committed (its progress follows its commit) before the stop can interrupt it:
        # a bound of its own, not what the batch in flight left of ``settle`` (a batch that took 29 s of 30 left
        # its commit one second on a loaded machine)
        deadline = time.monotonic() + settle
        while gate.last is not None and query.isActive and not _progress_reached(query, gate.last):
            if time.monotonic() >= deadline:
                progress = query.lastProgress
                _LOGGER.warning("batch %s ran but Spark had not committed it after %g s (its last progress: %s): "
                                "stopping the query may interrupt its commit (the next run on the checkpoint "
                                "replays it)", gate.last, settle,
                                "none" if progress is None else f"batch {progress['batchId']}")
                break
            time.sleep(0.05)
    else:
        while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
            time.sleep(0.05)
    query.stop()
    try:
        query.awaitTermination()
    except Exception:
        if gate is None or not gate.refused:
            raise
        _LOGGER.info("stopped between batches: batch %s was not run (the next run on the checkpoint replays it)",
                     ", ".join(map(str, gate.refused)))


def _progress_reached(query: Any, batch_id: int) -> bool:
    progress = query.lastProgress
    return progress is not None and int(progress["batchId"]) >= batch_id


def await_batches(query: Any, max_batches: int | None, poll: float = 0.2, settle: float = 30.0) -> None:
    """Wait until ``max_batches`` batches of this run completed, or until the query terminates. The query is then
    stopped between two batches (:func:`stop_between_batches`, waiting up to ``settle`` seconds for the batch in
    flight), so that no batch is interrupted half-sent. The batches are counted from the start of this query,
    whatever batch id its checkpoint resumes from: ``--max-batches 3`` twice on one checkpoint runs 3 batches,
    then 3 more. A query :func:`start_writer` or :func:`start_syphon` started refuses the batch after the last
    (:class:`BatchGate`: it does nothing, and the next run replays it); another is counted by its progress
    reports since this call, and stopped once they show ``max_batches``."""
    gate = _GATES.get(str(query.id))
    if gate is not None:
        gate.limit = max_batches
    first: int | None = None  # another query: the first batch id its progress showed here

    def done() -> bool:
        nonlocal first
        if max_batches is None:
            return False
        if gate is not None:
            return gate.ran >= max_batches or bool(gate.refused)
        progress = query.lastProgress
        if progress is None:
            return False
        if first is None:
            first = int(progress["batchId"])
        return int(progress["batchId"]) - first + 1 >= max_batches

    while query.isActive and not done():
        try:
            query.awaitTermination(poll)
        except Exception:
            if not done():  # the query failed by itself
                raise
            break  # the batch after the last was refused and ended the query before this loop saw it: not a failure
    if done():
        stop_between_batches(query, settle)  # a batch the gate refused ended the query: not a failure
        return
    _GATES.pop(str(query.id), None)
    query.awaitTermination()


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=f"This job {_NEEDS_SPARK}.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", required=True,
                        help="spark-sb YAML configuration (a local path, or /dbfs/..., /Volumes/..., /Workspace/...)")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="log every library's lines too: the Azure SDK's connections and HTTP requests, "
                        "py4j's tracebacks, spark-sb's DEBUG lines and the whole error of a failure (default: "
                        "spark-sb's own lines at INFO, every other library's at WARNING and above, a failure in "
                        "one line; a root logger configured before the job keeps its handlers)")
    parser.add_argument("--log-config", metavar="FILE", default=None,
                        help="configure logging from FILE instead (Python's logging.config: a dictConfig in "
                        "YAML or JSON, or a fileConfig .ini/.cfg/.conf); --verbose is then ignored")
    return parser


def _load(prog: str, conf: str, check: Callable[[Any], None] = lambda config: None) -> Any:
    """The configuration, or exit 2 with the error (which names the option and the value)."""
    try:
        config = load_config(Path(conf))
        check(config)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return config


#: the format of the jobs' log lines on the console
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _QuietStops(logging.Filter):
    """On py4j's ``py4j.clientserver`` logger: drops its record "There was an exception while executing the Python
    Proxy on the Python Side" (an ERROR with the traceback) for a batch a job stopped on purpose
    (:class:`StoppedBetweenBatches`, :class:`~spark_sb.syphon.PrimaryDownError`), and, unless ``verbose``, for
    any failure of a ``foreachBatch`` function: that error fails the query, and the job says it in one line."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        if not self.verbose:
            return False
        from .syphon import PrimaryDownError

        return not isinstance(error, (StoppedBetweenBatches, PrimaryDownError))


def configure_logging(verbose: bool = False, log_config: str | os.PathLike[str] | None = None) -> None:
    """The jobs' logging. ``log_config``: a file for Python's ``logging.config`` (``.ini``, ``.cfg`` or ``.conf``:
    ``fileConfig``; anything else: a ``dictConfig`` in YAML or JSON), applied as it is (loggers that exist stay
    enabled unless it says ``disable_existing_loggers: true``). Else spark-sb's own loggers (``spark_sb``) log at
    INFO and every other library's (``azure``, the AMQP stack, ``urllib3``, ``py4j``...) at WARNING, on stderr
    with :data:`LOG_FORMAT`; ``verbose``: every library's at INFO and spark-sb's at DEBUG. A root logger that
    already has a handler (an application that configured logging before calling the job) keeps it: no second
    one is added. Either way a batch a job stopped on purpose prints no traceback (:class:`_QuietStops`).
    Raises :class:`ConfigError` for a ``log_config`` that cannot be read or applied."""
    import logging.config

    py4j = logging.getLogger("py4j.clientserver")
    for old in [f for f in py4j.filters if isinstance(f, _QuietStops)]:
        py4j.removeFilter(old)
    if log_config is not None:
        path = Path(log_config)
        try:
            if path.suffix.lower() in (".ini", ".cfg", ".conf"):
                if not path.is_file():
                    raise FileNotFoundError(f"no such file: {path}")
                logging.config.fileConfig(path, disable_existing_loggers=False)
            else:
                import yaml

                settings = yaml.safe_load(path.read_text())
                if not isinstance(settings, dict):
                    raise ValueError("not a dictConfig mapping (version: 1, handlers, loggers, root...)")
                logging.config.dictConfig({"disable_existing_loggers": False, **settings})
        except Exception as err:  # noqa: BLE001 - any fault of the file is the user's to fix
            raise ConfigError("--log-config", f"{path}: {type(err).__name__}: {err}") from err
        py4j.addFilter(_QuietStops(verbose=True))
        return
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("spark_sb").setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("py4j").setLevel(logging.WARNING)  # one INFO line per gateway call otherwise
    py4j.addFilter(_QuietStops(verbose))


def _logging(prog: str, args: argparse.Namespace) -> None:
    """:func:`configure_logging` from the job's arguments, or exit 2 naming what is wrong with ``--log-config``."""
    try:
        configure_logging(args.verbose, args.log_config)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _one_line(err: BaseException) -> str:
    """What failed, in one line: the error's class and message (the last ``Error``/``Exception`` line of the Python
    traceback a Spark error carries, the class without its module), at most 1,000 characters. A spark-sb error is
    found as :func:`spark_sb.errors.unwrap` finds it (the one a user's own code gets back the same way)."""
    from .errors import redact, unwrap

    ours = unwrap(err)
    if ours is not None and str(ours).strip():
        return f"{type(ours).__name__}: {redact(str(ours)).strip().splitlines()[0]}"[:1000]
    lines = [line.strip() for line in redact(str(err)).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)
             and not line.startswith(("py4j.", "org.apache.spark.", "java.", "pyspark."))]
    if named:
        line = named[-1]
        name, _, message = line.partition(": ")
        return f"{name.rsplit('.', 1)[-1]}: {message}"[:1000]
    # a failure of the JVM's (Py4JJavaError: "An error occurred while calling o53.load." says only where): the
    # Java exception it carries, e.g. a job aborted because an executor was lost
    java = [found for line in lines if (found := re.match(r"^:?\s*([\w.$]+(?:Error|Exception)): (.+)", line))]
    if java:
        return f"{java[0][1].rsplit('.', 1)[-1]}: {java[0][2]}"[:1000]
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:1000]


def _refused_credentials(config: Any, checks: Sequence[tuple[str, Any, str]]) -> None:
    """Ping (schedule and cancel: nobody receives it) each ``(side, namespace config, entity)`` at once, each
    bounded by ``send_availability.primary_try_timeout`` without retries, and raise the first rejected credential
    (:class:`~spark_sb.errors.CredentialRejectedError`, naming the namespace, its host and the refusal). Any other
    answer, or none (a namespace down, an entity not there yet), is not this check's business."""
    from concurrent.futures import ThreadPoolExecutor

    from .bus import Namespace
    from .errors import raise_if_refused

    kwargs = config.send_availability.primary_client_kwargs()

    def refused(side: str, namespace_config: Any, entity: str) -> BaseException | None:
        namespace = Namespace(side, namespace_config, kwargs)
        try:
            namespace.ping(entity)
        except Exception as exc:  # only a refusal counts here
            try:
                raise_if_refused(exc, f"{side} {namespace_config.fully_qualified_namespace}", entity=entity)
            except Exception as rejected:
                return rejected
            _LOGGER.debug("the credential check of %s %r got %s: left to the job", side, entity,
                          type(exc).__name__)
        finally:
            namespace.close()
        return None

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="spark-sb-credentials") as pool:
        found = [pool.submit(refused, *check) for check in checks]
        for future in found:
            if (error := future.result()) is not None:
                raise error


def _first_backlog_queue(config: Any) -> list[tuple[str, Any, str]]:
    names = config.send_availability.backlog_queue_names()
    return [("secondary", config.secondary, names[0])] if names else []


def check_credentials(config: Any) -> None:
    """What both jobs check before Spark starts (:func:`_refused_credentials`): ``sink.entity`` on the primary,
    when the configuration names it (what the writer sends to, a destination of the syphon), and the first backlog
    queue on the secondary (where the writer fails over, what the syphon reads and re-parks to). A wrong key of the
    secondary passed every writer batch while the primary was up (found at the first failover, in an outage), and
    with an empty backlog the syphon never met the primary: a wrong primary key ended "the backlog is empty", exit
    0, run after run. A namespace that does not answer is left to the job: both run during an outage."""
    entity = config.sink.entity
    _refused_credentials(config, [*([("primary", config.primary, entity)] if entity else []),
                                  *_first_backlog_queue(config)])


def writer_main(argv: Sequence[str] | None = None) -> int:
    """``spark-sb-writer --conf FILE [--max-batches N] [--checkpoint DIR] [--verbose | --log-config FILE]``: the
    paired writer. It ends with one line on stderr saying what it sent and where; exit 1 with one line naming the
    error when its query failed (the next run on the checkpoint replays the batch), 2 for a configuration it
    cannot run or a credential refused before Spark starts (:func:`check_credentials`)."""
    parser = _parser("spark-sb-writer", "The paired writer: sends sink.source's rows to Service Bus through "
                     "the paired sink (writeStream.foreachBatch(PairedSink)).")
    parser.add_argument("--max-batches", type=int, default=None, metavar="N",
                        help="stop after N batches of this run (default sink.max_batches; unset: run until "
                        "stopped); a run on an existing checkpoint runs N more")
    parser.add_argument("--checkpoint", default=None, help="overrides sink.checkpoint_location")
    args = parser.parse_args(argv)
    if args.max_batches is not None and args.max_batches < 1:
        parser.error(f"--max-batches: must be 1 or more, got {args.max_batches}")
    require_spark(parser.prog)
    _logging(parser.prog, args)
    config = _load(parser.prog, args.conf)
    try:
        check_credentials(config)
    except SparkSbError as err:  # a rejected credential: nothing started
        print(f"{parser.prog}: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    spark = build_session("spark-sb-paired-writer")
    from pyspark.errors import StreamingQueryException

    max_batches = args.max_batches or config.sink.max_batches
    started = time.monotonic()
    try:
        query, sink = start_writer(spark, config, checkpoint=args.checkpoint)
        try:
            await_batches(query, max_batches)
        except StreamingQueryException as err:
            _LOGGER.debug("the writer query failed: %s", err)
            print(f"{parser.prog}: the writer query failed after {sink.totals.batches} batches (the next run "
                  f"replays its batch from the checkpoint): {_one_line(err)}", file=sys.stderr)
            raise SystemExit(EXIT_QUERY_FAILED) from None
    except Exception as err:  # before the query ran: its source, its sink
        _LOGGER.debug("the writer failed", exc_info=True)
        print(f"{parser.prog}: the writer failed: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(EXIT_QUERY_FAILED) from None
    totals = sink.totals
    parked = f"; {totals.backlog_total} of them wait in the backlog for the syphon" if totals.backlog_total else ""
    ending = (f"stopped after --max-batches {max_batches}" if max_batches is not None else "the query stopped")
    print(f"{parser.prog}: {totals.batches} batches in {time.monotonic() - started:.0f} s, {totals.describe()}"
          f"{parked}; {ending}", file=sys.stderr)
    return 0


# --- the syphon ------------------------------------------------------------------------------------------

def start_syphon(spark: Any, conf: Any, *, max_per_trigger: int | None = None,
                 receive_timeout: float = 1.0, available_now: bool = False, republisher: Any = None
                 ) -> tuple[Any, Any]:
    """Start the syphon query; returns ``(query, republisher)``. ``available_now``: ``trigger(availableNow=True)``
    (Spark 4.2 and later): the query moves what the backlog held when it started, then stops. ``republisher``: a
    :class:`~spark_sb.republisher.Republisher` of an earlier query on the same checkpoint to go on with (its
    totals add up; a new one by default). Raises ``ConfigError`` when the checkpoint or the ledger location is
    missing, before anything starts, and :class:`~spark_sb.errors.UnsupportedSparkError` on a Spark without what
    it needs."""
    from .republisher import Republisher
    from .source import config_options, register

    config = load_config(conf)
    if republisher is None:
        republisher = Republisher(config)  # refuses a configuration without checkpoint or ledger
    register(spark)
    stream = (spark.readStream.format("servicebus-backlog")
              .options(**config_options(config))  # by reference: no secret in the plan
              .option("maxMessagesPerTrigger", str(max_per_trigger or config.syphon.max_messages_per_trigger))
              .option("receiveTimeout", str(receive_timeout))
              .load())
    log_batch_steps(spark, "spark-sb-syphon")
    gate = _gated(republisher)
    writer = stream.writeStream.foreachBatch(gate).option("checkpointLocation",
                                                                  config.syphon.checkpoint_location)
    if available_now:
        if not trigger_available_now():
            raise UnsupportedSparkError(f"the syphon's trigger(availableNow=True) needs Spark 4.2 or later: Spark "
                                        f"{spark_version()}'s Python sources do not support it (use "
                                        "spark_sb.jobs.await_until_empty)")
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.syphon.retry_interval.total_seconds()} seconds")
    return _started(writer.queryName("spark-sb-syphon").start(), gate), republisher


_STEPS = ("latestOffset", "addBatch", "walCommit", "commitOffsets")
_LISTENING: set[int] = set()


def log_batch_steps(spark: Any, query_name: str) -> None:
    """Log Spark's time per step of each batch of the query named ``query_name`` (once per session): the
    source's ``latestOffset`` (completing the last batch, taking the batch received ahead), ``addBatch`` (the
    foreachBatch, which logs its own steps) and the offset and commit logs."""
    from pyspark.sql.streaming import StreamingQueryListener

    if id(spark) in _LISTENING:
        return

    class _Steps(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            progress = event.progress
            if progress.name != query_name or not progress.numInputRows:
                return
            durations = progress.durationMs
            _LOGGER.info("batch %d: %d messages in %.2f s (%s)", progress.batchId, progress.numInputRows,
                         durations.get("triggerExecution", 0) / 1000,
                         ", ".join(f"{step} {durations.get(step, 0) / 1000:.2f} s" for step in _STEPS))

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            pass

    spark.streams.addListener(_Steps())
    _LISTENING.add(id(spark))


def _backlog_depth(progress: Any) -> int | None:
    """The backlog depth the source reported in this progress (``None`` when it reported none)."""
    try:
        offset = progress["sources"][0].get("latestOffset")
        return int((json.loads(offset) if isinstance(offset, str) else offset)["backlogDepth"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


#: ``spark-sb-syphon``'s exit status when its syphon query failed (the error is printed)
EXIT_QUERY_FAILED = 1
#: ``spark-sb-syphon --until-empty``'s exit status when it stopped with messages left in the backlog, or without
#: knowing the backlog's depth (what it left is printed): the job works, the backlog is not empty yet
EXIT_BACKLOG_LEFT = 3


@dataclasses.dataclass(frozen=True)
class UntilEmpty:
    """How ``--until-empty`` ended. ``empty``: the backlog depth was seen at 0 (never when it was unknown).
    ``depth``: the depth when it stopped (0 when empty; None when the administration API gave none). ``why``:
    one sentence for the log and the job's output. ``primary_down``: it stopped because the primary namespace did
    not answer (before a run, or during a batch: :func:`primary_check`), having re-parked nothing since."""

    empty: bool
    depth: int | None
    why: str
    primary_down: bool = False


#: how long a job waits at its end (``--timeout``, ``--max-batches``) for the batch in flight to finish
STOP_SETTLE = 30.0


def _waiting(depth: int | None) -> str:
    if depth is None:
        return ("an unknown number of messages wait in the backlog (the secondary's administration API gave no "
                "count)")
    return f"{depth} message{' waits' if depth == 1 else 's wait'} in the backlog"


def _primary_down(depth: int | None, cause: str) -> UntilEmpty:
    return UntilEmpty(False, depth, f"the primary is down, {_waiting(depth)} ({cause})", primary_down=True)


#: the cause :func:`_primary_down` names when a batch found the primary down
_DOWN_MID_RUN = "it stopped answering during a batch, which re-parked nothing and is replayed by the next run"


def primary_check(conf: Any) -> UntilEmpty | None:
    """What the syphon job asks before a run moves anything: whether the primary namespace answers at all
    (:func:`spark_sb.syphon.probe_primary`: one ping of an entity that does not exist, bounded by
    ``send_availability.primary_try_timeout``). None when it answers, or when the backlog is empty anyway; else
    how the run ends without moving or re-parking anything: "the primary is down, N messages wait in the
    backlog" (N from :func:`spark_sb.source.backlog_depth`), logged as a warning."""
    from .syphon import probe_primary

    config = load_config(conf)
    failure = probe_primary(config)
    if failure is None:
        return None
    from .source import backlog_depth

    outcome = _primary_down(backlog_depth(config), f"{type(failure).__name__}: {_first_line(failure)}")
    if outcome.depth == 0:
        return None
    _LOGGER.warning("syphon: %s; nothing moved or re-parked", outcome.why)
    return outcome


def _first_line(err: BaseException, most: int = 200) -> str:
    from .errors import redact

    lines = redact(str(err)).strip().splitlines()
    return (lines[0] if lines else "")[:most]


def _stopped_for_primary(err: BaseException, republisher: Any) -> bool:
    """Whether the query failed because a batch found the primary down (:class:`~spark_sb.syphon.PrimaryDownError`:
    a stop, not a failure)."""
    return getattr(republisher, "primary_down", None) is not None or "PrimaryDownError" in str(err)


def _left(depth: int | None) -> str:
    if depth is None:
        return ("the backlog depth unknown (the secondary's administration API gave no count), so the backlog "
                "may still hold messages")
    return f"{depth} message{'' if depth == 1 else 's'} left in the backlog"


def _bound(timeout: float | None) -> float | None:
    """The monotonic deadline of ``timeout`` seconds from now; None for no bound (``timeout`` 0 or None)."""
    return time.monotonic() + timeout if timeout else None


def await_until_empty(query: Any, idle_batches: int = 2, timeout: float | None = 300.0, poll: float = 0.5,
                      depth: Callable[[], int | None] | None = None, settle: float = 30.0,
                      republisher: Any = None) -> UntilEmpty:
    """Stop the query once ``idle_batches`` consecutive triggers found nothing and the backlog depth is 0, or after
    ``timeout`` seconds (0 or None: no bound, until the backlog is empty); returns how it ended
    (:class:`UntilEmpty`) and logs a warning naming what it left when the backlog was not seen empty. The depth
    counts messages still locked by a run that died (they come back when their lock expires, up to the queue's
    lock duration later), which a trigger alone does not see. It is the one the source reports in the query
    progress (Spark 4.2), else ``depth()`` (e.g. ``lambda: spark_sb.source.backlog_depth(config)``, from the
    administration API) where Spark has no ``reportLatestOffset`` (4.0, 4.1). An unknown depth (neither gives
    one, e.g. the administration API does not answer) is never taken for an empty backlog: the loop goes on
    asking, within ``timeout``. At the timeout the batch in flight may finish first (up to ``settle`` seconds,
    as :func:`await_batches` does), so that the depth it reports is counted between two batches. A query that
    failed raises its error (``StreamingQueryException``), as ``awaitTermination`` does, but for a batch that found
    the primary down (:class:`~spark_sb.syphon.PrimaryDownError`, raised by ``republisher``, the query's
    foreachBatch): that ends it with the primary down (:attr:`UntilEmpty.primary_down`)."""
    started, deadline = time.monotonic(), _bound(timeout)
    idle, last, seen = 0, None, None
    try:
        while query.isActive and (deadline is None or time.monotonic() < deadline):
            progress = query.lastProgress
            if progress is not None and progress.get("timestamp") != last:
                last = progress.get("timestamp")
                rows = progress.get("numInputRows", 0)
                seen = _backlog_depth(progress)
                if seen is None and depth is not None and rows == 0:
                    seen = depth()
                idle = idle + 1 if rows == 0 and seen == 0 else 0
                if idle >= idle_batches:
                    break
            query.awaitTermination(poll)  # raises the error of a query that failed
        active = query.isActive
        # the batch in flight finishes, so that what is left is counted between two batches; raises the error of
        # a query that failed
        stop_between_batches(query, settle)
    except Exception as err:
        if not _stopped_for_primary(err, republisher):
            raise
        _GATES.pop(str(query.id), None)
        outcome = _primary_down(depth() if depth is not None else None, _DOWN_MID_RUN)
        _LOGGER.warning("syphon --until-empty: %s", outcome.why)
        return outcome
    if idle >= idle_batches:
        return UntilEmpty(True, 0, "the backlog is empty")
    if depth is not None:  # the depth now, not the last idle trigger's
        seen = depth()
    elapsed = time.monotonic() - started
    if active:
        why = f"stopped after {elapsed:.0f} s (the --until-empty timeout, {timeout:g} s) with {_left(seen)}"
    else:
        why = f"the query stopped after {elapsed:.0f} s before the backlog was seen empty, with {_left(seen)}"
    _LOGGER.warning("syphon --until-empty: %s", why)
    return UntilEmpty(False, seen, why)


def run_available_now(spark: Any, conf: Any, timeout: float | None = 300.0, *, settle: float = STOP_SETTLE,
                      republisher: Any = None) -> tuple[Any, UntilEmpty]:
    """The syphon's ``--until-empty`` where Spark offers ``Trigger.AvailableNow`` (4.2): a run moves what the
    backlog held when it started, then stops. Then it asks the backlog's depth
    (:func:`spark_sb.source.backlog_depth`): messages that run re-parked (their destination was down) and
    messages the sink parked while it ran are new messages in the backlog, so another run follows after
    ``syphon.retry_interval`` until the depth is 0, or until ``timeout`` seconds passed (0 or None: no bound).
    The timeout bounds the runs too: at it, the batch in flight finishes (up to ``settle`` seconds) and the run
    stops between two batches. Before each run, :func:`primary_check`: with the primary down it ends at once,
    moving and re-parking nothing; a batch that finds it down (:class:`~spark_sb.syphon.PrimaryDownError`) ends
    it too. An unknown depth (the administration API gave none) is not an empty backlog. Returns the republisher
    (``republisher``, else a new one; one for every run, so its totals add up) and how it ended
    (:class:`UntilEmpty`), having logged a warning naming what it left when the backlog is not empty. A run that
    failed raises its error (``StreamingQueryException``: e.g. the source's ``SourceUnavailableError``)."""
    from .republisher import Republisher
    from .source import backlog_depth

    config = load_config(conf)
    republisher = republisher or Republisher(config)
    started, deadline = time.monotonic(), _bound(timeout)

    def over() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    def timed_out(what: str) -> UntilEmpty:
        left = backlog_depth(config)
        if left == 0:
            return UntilEmpty(True, 0, "the backlog is empty")
        why = (f"stopped after {time.monotonic() - started:.0f} s (the --until-empty timeout, {timeout:g} s) "
               f"with {_left(left)}{what}")
        _LOGGER.warning("syphon --until-empty: %s", why)
        return UntilEmpty(False, left, why)

    while True:
        down = primary_check(config)
        if down is not None:
            return republisher, down
        query, _ = start_syphon(spark, config, available_now=True, republisher=republisher)
        try:
            if deadline is None:
                query.awaitTermination()  # raises the error of a run that failed
                _GATES.pop(str(query.id), None)  # the run ended itself, between two batches
            elif not query.awaitTermination(max(deadline - time.monotonic(), 0.001)):
                stop_between_batches(query, settle)  # the batch in flight finishes; raises a failure
                return republisher, timed_out("; messages parked while it ran wait for the next run")
            else:
                _GATES.pop(str(query.id), None)
        except Exception as err:
            _GATES.pop(str(query.id), None)
            if not _stopped_for_primary(err, republisher):
                raise
            outcome = _primary_down(backlog_depth(config), _DOWN_MID_RUN)
            _LOGGER.warning("syphon --until-empty: %s", outcome.why)
            return republisher, outcome
        left = backlog_depth(config)
        if left == 0:
            return republisher, UntilEmpty(True, 0, "the backlog is empty")
        if over():
            return republisher, timed_out("; messages parked while it ran wait for the next run")
        _LOGGER.info("the run left %s: another run in %s", _left(left), config.syphon.retry_interval)
        pause = config.syphon.retry_interval.total_seconds()
        time.sleep(pause if deadline is None else max(min(pause, deadline - time.monotonic()), 0))
        if over():
            return republisher, timed_out("")


def _listened(spark: Any, seconds: float = 5.0) -> None:
    """Wait (up to ``seconds``) until Spark's listeners heard every event so far, so that :func:`log_batch_steps`'
    line of the last batch comes before the job's last line."""
    try:
        spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty(int(seconds * 1000))
    except Exception:  # noqa: BLE001 - only the order of two lines is at stake
        _LOGGER.debug("could not wait for Spark's listeners", exc_info=True)


def _moved(republisher: Any) -> str:
    """What the syphon's batches did, for its last line: ``moved 750, re-parked 0, dead-lettered 0 in 3 batches``."""
    totals, batches = republisher.totals, republisher.batches
    return (f"moved {totals.get('delivered', 0)}, re-parked {totals.get('reparked', 0)}, dead-lettered "
            f"{totals.get('dead_lettered', 0)} in {batches} batch{'' if batches == 1 else 'es'}")


def _stream(spark: Any, config: Any, republisher: Any) -> None:
    """The syphon without ``--until-empty``: a stream until it is stopped. While the primary does not answer
    (:func:`primary_check`, before the query starts, and a batch that finds it down) no query runs: it is asked
    again every ``syphon.retry_interval``, and the query starts again (from its checkpoint) once it answers."""
    from pyspark.errors import StreamingQueryException

    pause = config.syphon.retry_interval.total_seconds()
    down: UntilEmpty | None = None
    while True:
        check = primary_check(config)
        if check is not None:
            if down is None:
                _LOGGER.warning("syphon: waiting for the primary, asked again every %s", config.syphon.retry_interval)
            down = check
            time.sleep(pause)
            continue
        if down is not None:
            _LOGGER.info("syphon: the primary answers again: the stream goes on")
            down = None
        query, _ = start_syphon(spark, config, republisher=republisher)
        try:
            query.awaitTermination()
            return
        except StreamingQueryException as err:
            _GATES.pop(str(query.id), None)
            if not _stopped_for_primary(err, republisher):
                raise
            republisher.primary_down = None
            _LOGGER.warning("syphon: the primary stopped answering during a batch: the stream waits for it (the "
                            "batch is replayed)")


def syphon_main(argv: Sequence[str] | None = None) -> int:
    """``spark-sb-syphon --conf FILE [--until-empty [--timeout SECONDS]] [--verbose | --log-config FILE]``: the
    syphon job.

    Before a run moves anything it asks whether the primary namespace answers (:func:`primary_check`); while it
    does not, nothing is moved or re-parked. It ends with one line on stderr saying what it did and what it left
    (``spark-sb-syphon: moved 750, re-parked 0, dead-lettered 0 in 3 batches; the backlog is empty``).

    Exit status: 0 when it stopped with the backlog empty (``--until-empty``); :data:`EXIT_QUERY_FAILED` (1) when
    the syphon query failed, its error named in that line (nothing is lost: the next run replays the batch from
    the checkpoint); :data:`EXIT_BACKLOG_LEFT` (3) when ``--until-empty`` stopped with messages left in the
    backlog: at its ``--timeout``, with the depth unknown (the administration API gave no count), or because the
    primary is down ("the primary is down, N messages wait in the backlog"). Messages parked or re-parked while it
    ran count as left: the next run moves them, but a scheduled run that ends with the backlog not empty does not
    report success. 2: a configuration or a Spark it cannot run on, or a credential refused before Spark starts
    (:func:`check_credentials`)."""
    parser = _parser("spark-sb-syphon", "The syphon: moves the messages parked in the backlog queues back to "
                     "the primary (servicebus-backlog source -> foreachBatch(Republisher)), recording each in "
                     "the Delta ledger syphon.ledger; its checkpoint is syphon.checkpoint_location. Before a run "
                     "moves anything it asks whether the primary namespace answers: while it does not, nothing is "
                     "moved or re-parked (--until-empty ends at once with exit status 3; the stream waits).")
    parser.add_argument("--until-empty", action="store_true",
                        help="move what the backlog holds and stop once it is empty (trigger(availableNow=True) "
                        "runs on Spark 4.2 and later, run again while the backlog is not empty; earlier, stop once "
                        f"a trigger found nothing and the backlog depth is 0); exit {EXIT_BACKLOG_LEFT}, saying "
                        "what it left, when the backlog is not empty (or its depth unknown) at --timeout, or when "
                        "the primary is down")
    parser.add_argument("--timeout", type=timeout_argument, default=300.0, metavar="DURATION",
                        help="how long --until-empty goes on, counted once Spark has started (5m, 300s or seconds; "
                        "default 300 s; 0: until the backlog is empty, without bound): at the timeout the batch in "
                        "flight finishes "
                        f"(up to {STOP_SETTLE:g} s more) and the job stops")
    args = parser.parse_args(argv)
    require_spark(parser.prog)
    try:
        require_python_data_sources(parser.prog)
    except UnsupportedSparkError as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    _logging(parser.prog, args)
    config = _load(parser.prog, args.conf, lambda config: config.syphon.require_job_locations())
    try:
        check_credentials(config)
    except SparkSbError as err:  # a rejected credential: nothing started
        print(f"{parser.prog}: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    spark = build_session("spark-sb-syphon")
    from pyspark.errors import StreamingQueryException

    from .republisher import Republisher
    from .source import backlog_depth

    republisher = Republisher(config)
    outcome: UntilEmpty | None = None
    try:
        if args.until_empty and trigger_available_now():
            _, outcome = run_available_now(spark, config, timeout=args.timeout, republisher=republisher)
        elif args.until_empty:  # an idle stream reports progress every second (not 10 s), and the loop stops it
            outcome = primary_check(config)
            if outcome is None:
                spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "1s")
                query, _ = start_syphon(spark, config, republisher=republisher)
                outcome = await_until_empty(query, timeout=args.timeout, depth=lambda: backlog_depth(config),
                                            settle=STOP_SETTLE, republisher=republisher)
        else:
            _stream(spark, config, republisher)
    except StreamingQueryException as err:
        _LOGGER.debug("the syphon query failed: %s", err)
        print(f"{parser.prog}: the syphon query failed after {_moved(republisher)} (nothing is lost: the next run "
              f"replays its batch from the checkpoint): {_one_line(err)}", file=sys.stderr)
        raise SystemExit(EXIT_QUERY_FAILED) from None
    except Exception as err:  # outside a query: the pre-check, the backlog's depth, the query's start
        _LOGGER.debug("the syphon failed", exc_info=True)
        print(f"{parser.prog}: the syphon failed after {_moved(republisher)}: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(EXIT_QUERY_FAILED) from None
    _listened(spark)
    if outcome is None:  # the stream stopped (stopped by someone)
        outcome = UntilEmpty(False, None, f"the query stopped, {_left(backlog_depth(config))}")
        print(f"{parser.prog}: {_moved(republisher)}; {outcome.why}", file=sys.stderr)
        return 0
    print(f"{parser.prog}: {_moved(republisher)}; {outcome.why}", file=sys.stderr)
    if not outcome.empty:
        raise SystemExit(EXIT_BACKLOG_LEFT)
    return 0
