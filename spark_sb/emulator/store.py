"""Where the broker of one emulated namespace keeps what must survive a restart.

Two implementations share one small interface:

- ``SqliteStore(path)``: durable. One SQLite database file per namespace, in WAL mode with
  ``synchronous=NORMAL``: a committed transaction survives a killed process (not a power cut).
- ``MemoryStore()``: the same interface over plain dicts. Nothing survives the process; it exists so a
  benchmark can compare durable and in-memory throughput, and for throwaway namespaces.

What is stored: entity descriptions (kind, path, the JSON of ``model.spec_to_dict(spec)``, creation
time), messages (every field of ``broker.Stored`` except the lock, which lives in memory only: after a
restart every message is unlocked, as when a lock expires on the service), session state, the
duplicate-detection history and each queue's and topic's last sequence number.

Every method runs in the current transaction when one is open (``with store.transaction():``), else
in a transaction of its own that is committed before the method returns. The broker opens one
transaction per operation, so a batch of sent messages is one commit.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import limits
from .broker import DLQ_SUFFIX, Stored
from .model import spec_from_stored, spec_to_dict

_LOGGER = logging.getLogger(__name__)

_SCHEMA_VERSION = 1


@dataclass
class Loaded:
    """Everything the broker needs to rebuild its in-memory indexes at start."""

    entities: list[tuple[Any, float]] = field(default_factory=list)  # (spec, created_at)
    messages: list[Stored] = field(default_factory=list)  # in sequence order, unlocked
    session_states: list[tuple[str, str, bytes, float]] = field(default_factory=list)  # entity, id, state, updated
    duplicates: list[tuple[str, str, int, float]] = field(default_factory=list)  # entity, message id, seq, time
    last_sequence_number: int = 0  # stores written before per-entity numbers: the namespace-wide last one
    sequences: dict[str, int] = field(default_factory=dict)  # queue or topic path -> its last sequence number


def entity_path(spec: Any) -> str:
    """The path an entity is known by: the queue or topic name, or ``topic/subscriptions/name``."""
    path: str = spec.path if spec.kind == "subscription" else spec.name
    return path


def _row(m: Stored) -> tuple[Any, ...]:
    # The column order is the field order of Stored, so Stored(*row) rebuilds it.
    return (
        m.entity,
        m.sequence_number,
        m.raw,
        m.message_id,
        m.session_id,
        m.enqueued_time,
        m.expires_at,
        m.scheduled_enqueue_time,
        m.partition_key,
        m.delivery_count,
        m.state,
        m.dead_letter_reason,
        m.dead_letter_description,
        m.dead_letter_source,
    )


class Store:
    """The interface the broker uses. Subclasses implement the ``_``-free methods below."""

    #: what a stored message costs in memory besides its encoded bytes (the broker's indexes and its copy of the
    #: message), counted against the entity's size quota (:data:`spark_sb.emulator.limits.STORED_MESSAGE_OVERHEAD`)
    message_overhead = limits.STORED_MESSAGE_OVERHEAD

    def __init__(self) -> None:
        self._depth = 0

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group the calls made inside into one commit (nested uses join the outer transaction)."""
        if self._depth == 0:
            self._begin()
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self._rollback()
            raise
        self._depth -= 1
        if self._depth == 0:
            self._commit()

    def _begin(self) -> None:
        pass

    def _commit(self) -> None:
        pass

    def _rollback(self) -> None:
        pass

    def load_all(self) -> Loaded:
        raise NotImplementedError

    def put_entity(self, spec: Any, created_at: float) -> None:
        """Insert or replace an entity description."""
        raise NotImplementedError

    def delete_entity(self, path: str) -> None:
        """Remove the entity with its messages (and its dead-letter sub-queue's), session state and history."""
        raise NotImplementedError

    def add_messages(
        self, messages: list[Stored], duplicates: list[tuple[str, str, int, float]], sequences: dict[str, int]
    ) -> None:
        """One accepted send: the new messages, their duplicate-detection history rows, and the new last
        sequence number of the queue or topic they were sent to ({path: number})."""
        raise NotImplementedError

    def update_messages(self, messages: Iterable[Stored]) -> None:
        """Store the delivery count and state of messages that stay where they are."""
        raise NotImplementedError

    def replace_raw(self, messages: Iterable[Stored]) -> None:
        """Store the encoded bytes of messages whose properties a settlement modified."""
        raise NotImplementedError

    def move_messages(self, moves: Iterable[tuple[str, Stored]]) -> None:
        """(old entity, message already carrying its new entity and dead-letter fields)."""
        raise NotImplementedError

    def delete_messages(self, keys: Iterable[tuple[str, int]]) -> None:
        """(entity, sequence number) pairs; unknown pairs are ignored."""
        raise NotImplementedError

    def put_session_state(self, entity: str, session_id: str, state: bytes | None, updated: float) -> None:
        """``None`` removes the state."""
        raise NotImplementedError

    def delete_duplicates(self, entity: str, message_ids: Iterable[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- SQLite

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    last_sequence_number INTEGER NOT NULL
);
INSERT OR IGNORE INTO meta (id, last_sequence_number) VALUES (0, 0);
CREATE TABLE IF NOT EXISTS sequences (
    entity TEXT PRIMARY KEY,
    last INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS entities (
    path TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    entity TEXT NOT NULL,
    seq INTEGER NOT NULL,
    raw BLOB NOT NULL,
    message_id TEXT,
    session_id TEXT,
    enqueued_time REAL NOT NULL,
    expires_at REAL,
    scheduled_enqueue_time REAL,
    partition_key TEXT,
    delivery_count INTEGER NOT NULL,
    state INTEGER NOT NULL,
    dl_reason TEXT,
    dl_description TEXT,
    dl_source TEXT,
    PRIMARY KEY (entity, seq)
);
CREATE TABLE IF NOT EXISTS session_state (
    entity TEXT NOT NULL,
    session_id TEXT NOT NULL,
    state BLOB NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (entity, session_id)
);
CREATE TABLE IF NOT EXISTS duplicates (
    entity TEXT NOT NULL,
    message_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (entity, message_id)
);
"""

_INSERT_MESSAGE = "INSERT OR REPLACE INTO messages VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)"


class SqliteStore(Store):
    """Durable store: one SQLite file (WAL, synchronous=NORMAL) for one namespace."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are explicit (BEGIN/COMMIT in transaction()). The broker is used
        # from one thread at a time, but not necessarily the thread that built it.
        self._conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        conn = self._conn
        # 8 KiB pages hold seven 1 KiB messages with little waste (effective only when the file is new)
        conn.execute("PRAGMA page_size=8192")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > _SCHEMA_VERSION:
            conn.close()
            raise RuntimeError(
                f"emulator store {self.path}: schema version {version} is newer than this emulator ({_SCHEMA_VERSION})"
            )
        conn.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {_SCHEMA_VERSION}; COMMIT;")

    def _begin(self) -> None:
        self._conn.execute("BEGIN")

    def _commit(self) -> None:
        self._conn.execute("COMMIT")

    def _rollback(self) -> None:
        self._conn.execute("ROLLBACK")

    def load_all(self) -> Loaded:
        c = self._conn
        out = Loaded()
        for kind, spec, created in c.execute("SELECT kind, spec, created_at FROM entities ORDER BY path"):
            out.entities.append((spec_from_stored(kind, json.loads(spec)), created))
        out.messages = [Stored(*r) for r in c.execute("SELECT * FROM messages ORDER BY seq, entity")]
        out.session_states = list(c.execute("SELECT entity, session_id, state, updated FROM session_state"))
        out.duplicates = list(c.execute("SELECT entity, message_id, seq, time FROM duplicates"))
        out.last_sequence_number = c.execute("SELECT last_sequence_number FROM meta").fetchone()[0]
        out.sequences = dict(c.execute("SELECT entity, last FROM sequences"))
        return out

    def put_entity(self, spec: Any, created_at: float) -> None:
        with self.transaction():
            self._conn.execute(
                "INSERT OR REPLACE INTO entities VALUES (?,?,?,?)",
                (entity_path(spec), spec.kind, json.dumps(spec_to_dict(spec)), created_at),
            )

    def delete_entity(self, path: str) -> None:
        c = self._conn
        with self.transaction():
            c.execute("DELETE FROM entities WHERE path = ?", (path,))
            for entity in (path, path + DLQ_SUFFIX):
                c.execute("DELETE FROM messages WHERE entity = ?", (entity,))
                c.execute("DELETE FROM session_state WHERE entity = ?", (entity,))
            c.execute("DELETE FROM duplicates WHERE entity = ?", (path,))
            c.execute("DELETE FROM sequences WHERE entity = ?", (path,))

    def add_messages(
        self, messages: list[Stored], duplicates: list[tuple[str, str, int, float]], sequences: dict[str, int]
    ) -> None:
        c = self._conn
        with self.transaction():
            if messages:
                c.executemany(_INSERT_MESSAGE, map(_row, messages))
            if duplicates:
                c.executemany("INSERT OR REPLACE INTO duplicates VALUES (?,?,?,?)", duplicates)
            c.executemany("INSERT OR REPLACE INTO sequences VALUES (?,?)", sequences.items())

    def update_messages(self, messages: Iterable[Stored]) -> None:
        with self.transaction():
            self._conn.executemany(
                "UPDATE messages SET delivery_count = ?, state = ? WHERE entity = ? AND seq = ?",
                [(m.delivery_count, m.state, m.entity, m.sequence_number) for m in messages],
            )

    def replace_raw(self, messages: Iterable[Stored]) -> None:
        with self.transaction():
            self._conn.executemany(
                "UPDATE messages SET raw = ? WHERE entity = ? AND seq = ?",
                [(m.raw, m.entity, m.sequence_number) for m in messages],
            )

    def move_messages(self, moves: Iterable[tuple[str, Stored]]) -> None:
        with self.transaction():
            self._conn.executemany(
                "UPDATE messages SET entity = ?, delivery_count = ?, state = ?, dl_reason = ?,"
                " dl_description = ?, dl_source = ? WHERE entity = ? AND seq = ?",
                [
                    (m.entity, m.delivery_count, m.state, m.dead_letter_reason, m.dead_letter_description,
                     m.dead_letter_source, old, m.sequence_number)
                    for old, m in moves
                ],
            )

    def delete_messages(self, keys: Iterable[tuple[str, int]]) -> None:
        with self.transaction():
            self._conn.executemany("DELETE FROM messages WHERE entity = ? AND seq = ?", keys)

    def put_session_state(self, entity: str, session_id: str, state: bytes | None, updated: float) -> None:
        with self.transaction():
            if state is None:
                self._conn.execute(
                    "DELETE FROM session_state WHERE entity = ? AND session_id = ?", (entity, session_id)
                )
            else:
                self._conn.execute(
                    "INSERT OR REPLACE INTO session_state VALUES (?,?,?,?)", (entity, session_id, state, updated)
                )

    def delete_duplicates(self, entity: str, message_ids: Iterable[str]) -> None:
        with self.transaction():
            self._conn.executemany(
                "DELETE FROM duplicates WHERE entity = ? AND message_id = ?", [(entity, m) for m in message_ids]
            )

    def close(self) -> None:
        self._conn.close()


# --------------------------------------------------------------------------- in memory


class MemoryStore(Store):
    """The same interface over dicts; nothing is durable."""

    message_overhead = limits.MEMORY_STORE_MESSAGE_OVERHEAD  # it keeps a copy of every message's row besides

    def __init__(self) -> None:
        super().__init__()
        self._entities: dict[str, tuple[str, str, float]] = {}  # path -> (kind, spec JSON, created_at)
        self._messages: dict[tuple[str, int], list[Any]] = {}  # (entity, seq) -> row
        self._session_state: dict[tuple[str, str], tuple[bytes, float]] = {}
        self._duplicates: dict[tuple[str, str], tuple[int, float]] = {}
        self._sequences: dict[str, int] = {}

    def load_all(self) -> Loaded:
        out = Loaded(sequences=dict(self._sequences))
        for _path, (kind, spec, created) in sorted(self._entities.items()):
            out.entities.append((spec_from_stored(kind, json.loads(spec)), created))
        out.messages = [Stored(*row) for _k, row in sorted(self._messages.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
        out.session_states = [(e, s, st, up) for (e, s), (st, up) in self._session_state.items()]
        out.duplicates = [(e, m, seq, t) for (e, m), (seq, t) in self._duplicates.items()]
        return out

    def put_entity(self, spec: Any, created_at: float) -> None:
        self._entities[entity_path(spec)] = (spec.kind, json.dumps(spec_to_dict(spec)), created_at)

    def delete_entity(self, path: str) -> None:
        self._entities.pop(path, None)
        entities = (path, path + DLQ_SUFFIX)
        for mkey in [k for k in self._messages if k[0] in entities]:
            del self._messages[mkey]
        for skey in [k for k in self._session_state if k[0] in entities]:
            del self._session_state[skey]
        for dkey in [k for k in self._duplicates if k[0] == path]:
            del self._duplicates[dkey]
        self._sequences.pop(path, None)

    def add_messages(
        self, messages: list[Stored], duplicates: list[tuple[str, str, int, float]], sequences: dict[str, int]
    ) -> None:
        store = self._messages
        for m in messages:
            store[(m.entity, m.sequence_number)] = list(_row(m))
        for entity, message_id, seq, t in duplicates:
            self._duplicates[(entity, message_id)] = (seq, t)
        self._sequences.update(sequences)

    def update_messages(self, messages: Iterable[Stored]) -> None:
        for m in messages:
            row = self._messages.get((m.entity, m.sequence_number))
            if row is not None:
                row[9] = m.delivery_count
                row[10] = m.state

    def replace_raw(self, messages: Iterable[Stored]) -> None:
        for m in messages:
            row = self._messages.get((m.entity, m.sequence_number))
            if row is not None:
                row[2] = m.raw

    def move_messages(self, moves: Iterable[tuple[str, Stored]]) -> None:
        for old, m in moves:
            if self._messages.pop((old, m.sequence_number), None) is not None:
                self._messages[(m.entity, m.sequence_number)] = list(_row(m))

    def delete_messages(self, keys: Iterable[tuple[str, int]]) -> None:
        for key in keys:
            self._messages.pop(key, None)

    def put_session_state(self, entity: str, session_id: str, state: bytes | None, updated: float) -> None:
        if state is None:
            self._session_state.pop((entity, session_id), None)
        else:
            self._session_state[(entity, session_id)] = (bytes(state), updated)

    def delete_duplicates(self, entity: str, message_ids: Iterable[str]) -> None:
        for m in message_ids:
            self._duplicates.pop((entity, m), None)
