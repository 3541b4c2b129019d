"""Service Bus SQL filters and rule actions: a small recursive-descent parser and evaluator.

The grammar is the part of Service Bus's SQL syntax that filters and actions use in practice (Microsoft's
samples and documentation):

- filter:     an expression with AND, OR, NOT, parentheses; comparisons ``= <> != < <= > >=``;
              ``[NOT] IN (v, ...)``; ``[NOT] LIKE 'pattern' [ESCAPE 'c']`` (``%`` and ``_``);
              ``IS [NOT] NULL``; arithmetic ``+ - * / %``; ``TRUE``/``FALSE``; literals ('text', numbers);
              parameters ``@name``; properties ``name``, ``user.name``, ``[a name]``, ``sys.Label`` etc.
- action:     statements separated by ``;``: ``SET property = expression`` and ``REMOVE property``
              (user properties; ``SET sys.Label``/``sys.To``/... for the system properties that may be set).

SQL's three-valued logic holds: a missing property is NULL, a comparison with NULL is unknown, and a filter
matches only when its value is TRUE. Not understood (refused with a clear error): functions such as
``EXISTS(...)`` and ``newid()``, and the system properties not listed in ``SYS_PROPERTIES``.

Errors are ``SqlError`` naming the text and the position; the broker turns them into the service's 400.

Limits (what the parser refuses, so that whatever it accepts can be evaluated): an expression of more
than ``MAX_EXPRESSION_LENGTH`` characters (Service Bus's quota for a SQL filter and for a rule action), an
action of more than ``MAX_ACTION_STATEMENTS`` statements (the service's 32 expressions per action), nesting
(parentheses, NOT, unary signs) deeper than ``MAX_NESTING``, and a number literal longer than
``MAX_NUMBER_LENGTH`` characters. Chains of AND, OR and of arithmetic are evaluated in a loop, not by
recursion, and LIKE is matched without backtracking (a regular expression with ``.*`` for ``%`` took
exponential time on a crafted pattern, holding the GIL, and froze every namespace of the process).

Evaluation is bounded in cost, not only in text (issue 49): a string result longer than ``MAX_STRING_LENGTH``
(the service's 32 KiB cap on a property) fails the expression, an integer result outside 64 bits (the service's
long) fails it with OverflowError, both checked before the result is built, and so statement by statement in an
action (``SET p = p+p`` written 32 times would have made a property 2^32 times longer). Under
:func:`evaluation_budget` (the broker opens one per message sent to a topic, for every rule of the topic) each
operation costs units (one, plus one per 64 characters it copies or scans); once the budget is spent the
expression being evaluated raises :class:`BudgetExceeded`, and so does every one after it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

_LOGGER = logging.getLogger(__name__)

#: sys.<name> (case-insensitive) -> the filter field of ``broker.Incoming.filter_fields``
SYS_PROPERTIES = {
    "label": "subject",
    "subject": "subject",
    "correlationid": "correlation_id",
    "messageid": "message_id",
    "to": "to",
    "replyto": "reply_to",
    "sessionid": "session_id",
    "replytosessionid": "reply_to_session_id",
    "contenttype": "content_type",
}

#: Service Bus's quota: "Maximum length of filter condition string: 1,024" (the same for a rule action)
MAX_EXPRESSION_LENGTH = 1024
#: Service Bus's quota: "Maximum number of expressions per rule action: 32"
MAX_ACTION_STATEMENTS = 32
#: parentheses, NOT and unary signs inside one another (the parser and the evaluator recurse on them)
MAX_NESTING = 32
#: characters of a number literal (the longest double has 309 digits; Python's int() refuses over 4,300)
MAX_NUMBER_LENGTH = 309
#: characters of a string result (a ``+`` of strings): Service Bus's "maximum size of a message property: 32 KB"
MAX_STRING_LENGTH = 32 * 1024
#: an integer result must lie within 64 bits (the service's long; unsigned, so that a ulong property passes)
_INT_BOUND = 2 ** 64
#: units one message may cost across every rule of its topic (filters and actions): a filter of a few operations
#: costs a few units, so 2,000 such rules (the service's limit of SQL filters per topic) take 10-20,000; the whole
#: budget is a fraction of a second of the reactor's time
DEFAULT_EVALUATION_BUDGET = 200_000

_KEYWORDS = {"AND", "OR", "NOT", "IN", "LIKE", "ESCAPE", "IS", "NULL", "TRUE", "FALSE", "SET", "REMOVE"}
_NAME = r"(?:\[[^\]]+\]|[A-Za-z_][A-Za-z0-9_$]*)"
_TOKEN = re.compile(
    r"\s*(?:"
    r"(?P<str>'(?:[^']|'')*')"
    r"|(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<param>@[A-Za-z_][A-Za-z0-9_]*)"
    rf"|(?P<ident>{_NAME}(?:\.{_NAME})?)"
    r"|(?P<op><>|!=|<=|>=|[=<>()+\-*/%,;])"
    r")"
)


class SqlError(ValueError):
    """An expression the emulator cannot parse or evaluate; the message names the text."""


class BudgetExceeded(SqlError):
    """The evaluation budget of the message is spent (:func:`evaluation_budget`)."""


class Budget:
    """What one message may still cost: ``left`` units of ``units``; ``reported``: the broker said it was spent."""

    def __init__(self, units: int) -> None:
        self.units = units
        self.left = units
        self.reported = False


_BUDGET: ContextVar[Budget | None] = ContextVar("spark_sb_emulator_sql_budget", default=None)


@contextmanager
def evaluation_budget(units: int = DEFAULT_EVALUATION_BUDGET) -> Iterator[Budget]:
    """Every expression evaluated inside (on this thread) shares ``units``; past them, :class:`BudgetExceeded`."""
    budget = Budget(units)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def current_budget() -> Budget | None:
    return _BUDGET.get()


def _charge(units: int) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.left -= units
        if budget.left < 0:
            raise BudgetExceeded(f"the message's evaluation budget of {budget.units} units, shared by every rule "
                                 f"of its topic, is spent")


@dataclass(frozen=True)
class _Tok:
    kind: str  # str, num, param, ident, op, kw, end
    value: Any
    pos: int


def _tokens(text: str, what: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    stripped = text.rstrip()
    while pos < len(stripped):
        m = _TOKEN.match(stripped, pos)
        if m is None or m.end() == pos:
            at = pos + (len(stripped[pos:]) - len(stripped[pos:].lstrip()))
            raise SqlError(f"{what} {_shown(text)}: unexpected {stripped[at:at + 20]!r} at position {at}")
        kind = m.lastgroup or ""
        raw = m.group(kind)
        start = m.start(kind)
        pos = m.end()
        value: Any = raw
        if kind == "str":
            value = raw[1:-1].replace("''", "'")
        elif kind == "num":
            value = _number(raw, text, start, what)
        elif kind == "ident" and raw.upper() in _KEYWORDS:
            kind, value = "kw", raw.upper()
        out.append(_Tok(kind, value, start))
    out.append(_Tok("end", None, len(stripped)))
    return out


def _number(raw: str, text: str, pos: int, what: str) -> int | float:
    shown = raw if len(raw) <= 40 else f"{raw[:20]}...{raw[-10:]}"
    if len(raw) > MAX_NUMBER_LENGTH:
        raise SqlError(f"{what} {_shown(text)}: the number literal {shown!r} at position {pos} has "
                       f"{len(raw)} characters; the emulator reads at most {MAX_NUMBER_LENGTH}")
    try:
        return float(raw) if any(c in raw for c in ".eE") else int(raw)
    except ValueError as err:  # out of Python's range: refused, not a crash
        raise SqlError(f"{what} {_shown(text)}: the number literal {shown!r} at position {pos} "
                       f"cannot be read ({err})") from err


def _shown(text: str) -> str:
    """The expression for an error message: all of it when it is short, else its start and its length."""
    return repr(text) if len(text) <= 200 else f"{text[:100]!r}... ({len(text)} characters)"


@dataclass
class Context:
    """What an expression reads: the message's system fields and user properties, and the parameters."""

    fields: Mapping[str, Any]
    properties: Mapping[str, Any]
    parameters: Mapping[str, Any]


Expr = Callable[[Context], Any]


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _text(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if v is not None and not isinstance(v, str | bool | int | float):
        return str(v)  # symbols, uuids: compared as their text
    return v


def _compare(op: str, a: Any, b: Any) -> bool | None:
    _charge(1)
    a, b = _text(a), _text(b)
    if a is None or b is None:
        return None
    if _is_num(a) and _is_num(b):
        pass
    elif type(a) is not type(b):
        return None if op not in ("=", "<>", "!=") else op != "="  # different types never equal
    if op == "=":
        return bool(a == b)
    if op in ("<>", "!="):
        return bool(a != b)
    if isinstance(a, bool):
        return None  # booleans are not ordered
    if op == "<":
        return bool(a < b)
    if op == "<=":
        return bool(a <= b)
    if op == ">":
        return bool(a > b)
    return bool(a >= b)


#: a LIKE segment: the characters between two ``%``, None standing for ``_`` (any one character)
_Segment = tuple["str | None", ...]


class _Like:
    """``text LIKE pattern``: ``%`` any run of characters, ``_`` any one, the ESCAPE character makes the next
    one literal (at the pattern's end it is itself literal).

    The pattern is split on ``%`` into fixed-length segments; the first must start the text, the last must end
    it, and each one between is placed at its leftmost occurrence after the previous one (leftmost is never
    worse for what follows: the classic greedy glob match). Nothing backtracks, so a match costs at most
    O(len(text) * len(pattern)), in C: ``str.find`` for a segment without ``_``, a regular expression of
    literals and ``.`` only (no repetition, so no backtracking) for one with it.
    """

    def __init__(self, pattern: str, escape: str | None) -> None:
        segments: list[list[str | None]] = [[]]
        i = 0
        while i < len(pattern):
            c = pattern[i]
            if escape is not None and c == escape and i + 1 < len(pattern):
                segments[-1].append(pattern[i + 1])
                i += 2
                continue
            if c == "%":
                segments.append([])
            else:
                segments[-1].append(None if c == "_" else c)
            i += 1
        self.segments: list[_Segment] = [tuple(s) for s in segments]
        self.finders = [self._finder(s) for s in self.segments[1:-1]]

    @staticmethod
    def _finder(seg: _Segment) -> Callable[[str, int, int], int]:
        """The leftmost start of ``seg`` in ``text[pos:end]``, or -1."""
        if None not in seg:
            literal = "".join(c for c in seg if c is not None)
            return lambda text, pos, end: text.find(literal, pos, end)
        regex = re.compile("".join("." if c is None else re.escape(c) for c in seg), re.DOTALL)

        def find(text: str, pos: int, end: int) -> int:
            m = regex.search(text, pos, end)
            return -1 if m is None else m.start()

        return find

    @staticmethod
    def _at(seg: _Segment, text: str, pos: int) -> bool:
        return all(c is None or text[pos + k] == c for k, c in enumerate(seg))

    def __call__(self, text: str) -> bool:
        segs = self.segments
        _charge(1 + len(text) * len(segs) // 64)
        first, last = segs[0], segs[-1]
        if len(segs) == 1:  # no %: the text is exactly as long as the pattern
            return len(text) == len(first) and self._at(first, text, 0)
        end = len(text) - len(last)
        if end < len(first) or not self._at(first, text, 0) or not self._at(last, text, end):
            return False
        pos = len(first)
        for seg, find in zip(segs[1:-1], self.finders, strict=True):
            if not seg:
                continue
            at = find(text, pos, end)
            if at < 0:
                return False
            pos = at + len(seg)
        return True


def _arith(op: str, a: Any, b: Any) -> Any:
    if a is None or b is None:
        return None
    if op == "+" and isinstance(a, str) and isinstance(b, str):
        n = len(a) + len(b)
        if n > MAX_STRING_LENGTH:  # refused before it is built
            raise SqlError(f"a string result of {n} characters; Service Bus caps a property at "
                           f"{MAX_STRING_LENGTH} (32 KiB)")
        _charge(1 + n // 64)
        return a + b
    if not (_is_num(a) and _is_num(b)):
        return None
    _charge(1)
    if op == "+":
        return _long(a + b)
    if op == "-":
        return _long(a - b)
    if op == "*":
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > 130:
            return _long(_INT_BOUND)  # refused before it is built
        return _long(a * b)
    if b == 0:
        return None
    if op == "/":
        return a // b if isinstance(a, int) and isinstance(b, int) else a / b
    return a % b


def _long(v: Any) -> Any:
    """``v``, when it is not an integer outside 64 bits."""
    if isinstance(v, int) and not -_INT_BOUND < v < _INT_BOUND:
        raise OverflowError("an integer result outside the 64-bit range of Service Bus's numbers (long)")
    return v


class _Parser:
    def __init__(self, text: str, what: str, parameters: Mapping[str, Any]) -> None:
        self.text = text
        self.what = what
        self.toks = _tokens(text, what)
        self.i = 0
        self.depth = 0
        self.parameters = {str(k).lstrip("@").lower(): v for k, v in (parameters or {}).items()}

    # -- helpers
    def fail(self, why: str, tok: _Tok | None = None) -> SqlError:
        tok = tok or self.toks[self.i]
        where = "the end" if tok.kind == "end" else f"{tok.value!r} at position {tok.pos}"
        return SqlError(f"{self.what} {_shown(self.text)}: {why} (at {where})")

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        if tok.kind != "end":
            self.i += 1
        return tok

    def accept(self, kind: str, value: Any = None) -> bool:
        tok = self.peek()
        if tok.kind == kind and (value is None or tok.value == value):
            self.i += 1
            return True
        return False

    def expect(self, kind: str, value: Any, why: str) -> None:
        if not self.accept(kind, value):
            raise self.fail(why)

    def nested(self, inner: Callable[[], Expr], tok: _Tok) -> Expr:
        """``inner()`` one level deeper; past ``MAX_NESTING``, a refusal (the parser recurses on nesting)."""
        if self.depth >= MAX_NESTING:
            raise self.fail(f"the expression nests parentheses, NOT and signs more than {MAX_NESTING} "
                            "levels deep", tok)
        self.depth += 1
        out = inner()
        self.depth -= 1
        return out

    def done(self) -> None:
        if self.peek().kind != "end":
            raise self.fail("unexpected text")

    # -- expressions
    def _chain(self, operand: Callable[[], Expr], kind: str, ops: tuple[str, ...],
               fold: Callable[[str, Any, Any], Any]) -> Expr:
        """``operand (op operand)*``, left-associative: every binary level of the grammar. Every operand is
        evaluated, then folded from the left in a loop (a nested closure per operator recursed as deep as the
        chain was long: a long OR chain was stored, then failed on every message)."""
        first = operand()
        rest: list[tuple[str, Expr]] = []
        while self.peek().kind == kind and self.peek().value in ops:
            op = str(self.take().value)
            rest.append((op, operand()))
        if not rest:
            return first

        def chain(c: Context) -> Any:
            value = first(c)
            for op, right in rest:
                value = fold(op, value, right(c))
            return value

        return chain

    def expression(self) -> Expr:
        return self._chain(self.conjunction, "kw", ("OR",), lambda _op, a, b: _or(a, b))

    def conjunction(self) -> Expr:
        return self._chain(self.negation, "kw", ("AND",), lambda _op, a, b: _and(a, b))

    def negation(self) -> Expr:
        tok = self.peek()
        if self.accept("kw", "NOT"):
            inner = self.nested(self.negation, tok)

            def neg(c: Context) -> Any:
                v = inner(c)
                return None if v is None else not _truth(v)

            return neg
        return self.predicate()

    def predicate(self) -> Expr:
        left = self.additive()
        tok = self.peek()
        if tok.kind == "op" and tok.value in ("=", "<>", "!=", "<", "<=", ">", ">="):
            self.take()
            right = self.additive()
            op = str(tok.value)
            return lambda c: _compare(op, left(c), right(c))
        negate = False
        if tok.kind == "kw" and tok.value == "NOT" and self.toks[self.i + 1].value in ("IN", "LIKE"):
            self.take()
            negate = True
            tok = self.peek()
        if self.accept("kw", "IN"):
            self.expect("op", "(", "IN needs a parenthesised list")
            items = [self.additive()]
            while self.accept("op", ","):
                items.append(self.additive())
            self.expect("op", ")", "missing ')' after the IN list")

            def in_list(c: Context) -> Any:
                v = left(c)
                if v is None:
                    return None
                found = any(_compare("=", v, item(c)) for item in items)
                return found != negate

            return in_list
        if self.accept("kw", "LIKE"):
            pat = self.take()
            if pat.kind != "str":
                raise self.fail("LIKE needs a 'pattern' string", pat)
            escape = None
            if self.accept("kw", "ESCAPE"):
                esc = self.take()
                if esc.kind != "str" or len(esc.value) != 1:
                    raise self.fail("ESCAPE needs a one-character string", esc)
                escape = esc.value
            matches = _Like(pat.value, escape)

            def like(c: Context) -> Any:
                v = _text(left(c))
                if v is None or not isinstance(v, str):
                    return None
                return matches(v) != negate

            return like
        if negate:
            raise self.fail("NOT must be followed by IN or LIKE here")
        if self.accept("kw", "IS"):
            negated = self.accept("kw", "NOT")
            self.expect("kw", "NULL", "IS needs NULL or NOT NULL")
            return lambda c: (left(c) is None) != negated
        return left

    def additive(self) -> Expr:
        return self._chain(self.multiplicative, "op", ("+", "-"), _arith)

    def multiplicative(self) -> Expr:
        return self._chain(self.unary, "op", ("*", "/", "%"), _arith)

    def unary(self) -> Expr:
        tok = self.peek()
        if self.accept("op", "-"):
            inner = self.nested(self.unary, tok)
            return lambda c: -v if _is_num(v := inner(c)) else None
        if self.accept("op", "+"):
            return self.nested(self.unary, tok)
        return self.primary()

    def primary(self) -> Expr:
        tok = self.take()
        if tok.kind in ("str", "num"):
            value = tok.value
            return lambda _c: value
        if tok.kind == "kw" and tok.value in ("TRUE", "FALSE"):
            flag = tok.value == "TRUE"
            return lambda _c: flag
        if tok.kind == "kw" and tok.value == "NULL":
            return lambda _c: None
        if tok.kind == "param":
            key = tok.value[1:].lower()
            if key not in self.parameters:
                raise self.fail(f"the parameter {tok.value} has no value (parameters: "
                                f"{', '.join('@' + k for k in self.parameters) or 'none'})", tok)
            value = self.parameters[key]
            return lambda _c: value
        if tok.kind == "op" and tok.value == "(":
            inner = self.nested(self.expression, tok)
            self.expect("op", ")", "missing ')'")
            return inner
        if tok.kind == "ident":
            if self.peek().kind == "op" and self.peek().value == "(":
                raise self.fail(f"functions such as {tok.value}(...) are not supported by the emulator", tok)
            return self.property(tok)
        raise self.fail("expected a value, a property or '('", tok)

    def property(self, tok: _Tok) -> Expr:
        scope, name = _split(tok.value)
        if scope == "sys":
            field = SYS_PROPERTIES.get(name.lower())
            if field is None:
                raise self.fail(f"the system property {tok.value!r} is not supported by the emulator", tok)
            return lambda c: c.fields.get(field)
        if scope not in ("", "user"):
            raise self.fail(f"unknown property scope {scope!r} (sys or user)", tok)
        return lambda c: _user(c.properties, name)


def _split(ident: str) -> tuple[str, str]:
    scope, _, name = ident.rpartition(".")
    if name.startswith("["):
        name = name[1:-1]
    return scope.lower(), name


def _user(props: Mapping[str, Any], name: str) -> Any:
    if name in props:
        return props[name]
    low = name.lower()
    for k, v in props.items():
        if str(k).lower() == low:
            return v
    return None


def _truth(v: Any) -> bool:
    return v is True


def _and(a: Any, b: Any) -> Any:
    _charge(1)
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return _truth(a) and _truth(b)


def _or(a: Any, b: Any) -> Any:
    _charge(1)
    if a is True or b is True:
        return True
    if a is None or b is None:
        return None
    return False


# --------------------------------------------------------------------------- the public API


def _within_limits(expression: Any, what: str) -> None:
    if not isinstance(expression, str) or not expression.strip():
        raise SqlError(f"{what} {expression!r}: the expression is empty")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise SqlError(f"{what} {expression[:60]!r}...: the expression is {len(expression)} characters long; "
                       f"Service Bus allows at most {MAX_EXPRESSION_LENGTH}")


def _parsed(what: str, expression: str, parse: Callable[[], Any]) -> Any:
    try:
        return parse()
    except RecursionError as err:  # the limits should make this unreachable: still a refusal, not a crash
        raise SqlError(f"{what} {_shown(expression)}: the expression nests too deeply") from err


def compile_filter(expression: str, parameters: Mapping[str, Any] | None = None) -> Callable[[Context], bool]:
    """A predicate that is True only when the expression is TRUE for the context. SqlError if unparsable or
    past a limit (see the module's docstring)."""
    _within_limits(expression, "SQL filter")

    def parse() -> Expr:
        p = _Parser(expression, "SQL filter", parameters or {})
        expr = p.expression()
        p.done()
        return expr

    expr = _parsed("SQL filter", expression, parse)
    return lambda c: expr(c) is True


#: system properties an action may set: sys.<name> -> filter field
SETTABLE_SYS = {k: v for k, v in SYS_PROPERTIES.items() if k not in ("messageid", "sessionid")}


@dataclass(frozen=True)
class Change:
    """One statement of an action: set (value is an expression) or remove a property."""

    scope: str  # "user" or "sys"
    name: str  # a user property's name, or the filter field of a system property
    value: Expr | None  # None: REMOVE


def compile_action(expression: str, parameters: Mapping[str, Any] | None = None) -> list[Change]:
    """The statements of a rule action (``SET a = expr; REMOVE b``). SqlError if unparsable or past a
    limit."""
    _within_limits(expression, "SQL action")
    return list(_parsed("SQL action", expression, lambda: _statements(expression, parameters)))


def _statements(expression: str, parameters: Mapping[str, Any] | None) -> list[Change]:
    p = _Parser(expression, "SQL action", parameters or {})
    changes: list[Change] = []
    while True:
        tok = p.take()
        if tok.kind != "kw" or tok.value not in ("SET", "REMOVE"):
            raise p.fail("a statement starts with SET or REMOVE", tok)
        target = p.take()
        if target.kind != "ident":
            raise p.fail("expected a property name", target)
        scope, name = _split(target.value)
        if scope == "sys":
            field = SETTABLE_SYS.get(name.lower())
            if field is None or tok.value == "REMOVE":
                raise p.fail(f"the system property {target.value!r} cannot be changed by the emulator", target)
            name = field
        elif scope not in ("", "user"):
            raise p.fail(f"unknown property scope {scope!r} (sys or user)", target)
        if tok.value == "SET":
            p.expect("op", "=", "SET needs '='")
            changes.append(Change("sys" if scope == "sys" else "user", name, p.expression()))
        else:
            changes.append(Change("user", name, None))
        if len(changes) > MAX_ACTION_STATEMENTS:
            raise p.fail(f"an action has at most {MAX_ACTION_STATEMENTS} statements", tok)
        if not p.accept("op", ";") or p.peek().kind == "end":
            break
    p.done()
    return changes


def apply_action(changes: list[Change], context: Context) -> tuple[dict[str, Any], dict[str, Any]]:
    """(new user properties, changed system fields) after the statements, evaluated in order."""
    props = dict(context.properties)
    fields: dict[str, Any] = {}
    for ch in changes:
        now = Context({**context.fields, **fields}, props, context.parameters)
        if ch.value is None:
            for k in [k for k in props if str(k).lower() == ch.name.lower()]:
                del props[k]
        elif ch.scope == "sys":
            fields[ch.name] = ch.value(now)
        else:
            for k in [k for k in props if str(k).lower() == ch.name.lower() and k != ch.name]:
                del props[k]
            value = ch.value(now)
            if value is None:
                props.pop(ch.name, None)
            else:
                props[ch.name] = value
    return props, fields


__all__ = ["SqlError", "BudgetExceeded", "Budget", "evaluation_budget", "current_budget", "Context", "Change", "compile_filter", "compile_action", "apply_action",
           "SYS_PROPERTIES", "MAX_EXPRESSION_LENGTH", "MAX_ACTION_STATEMENTS", "MAX_NESTING",
           "MAX_NUMBER_LENGTH", "MAX_STRING_LENGTH", "DEFAULT_EVALUATION_BUDGET"]
