"""The machine kit: what every state machine of the package shares.

A lifecycle (a request on the router, a room on MD, a WAN room on P, a breaker, ...) is a
pure function ``transition(state, event) -> (state, actions)`` over frozen dataclasses: the
state is data, an event says what happened, an action is what the I/O shell must do now. The
shell feeds events one at a time (under its lock, or from one queue) and performs the actions;
the machine never does I/O and never reads a clock (time comes in an event).

This module holds the parts that are the same for every machine:

* ``IllegalTransition``: the one base of every illegal-event error. An event that cannot
  happen in a state (a bug in the shell, or a peer breaking its contract) raises a subclass
  naming the machine, and the state is unchanged.
* ``table_machine(...)``: a transition function over a table of handlers keyed by
  ``(status, event type)``, the legal pairs one per row, or by the event type alone where
  the event is handled the same way in every live state. The terminal states are handled
  once: after the end, an event listed in ``after_end`` still goes to its handler
  (``IGNORE``: nothing changes), any other is illegal. A ``guard`` refuses events before the
  table sees them. ``actions`` lists the action types the machine produces, so that a
  ``Driver`` can check it performs every one.
* ``TableRow`` and ``rows_table(rows, error)``: a table written as rows, one a legal
  ``(status, event type)`` pair, each with its guard (why the event is illegal there after all)
  and the statuses it may lead to; ``diagram(rows)`` prints the rows as text or mermaid, so a
  machine's picture is read from the table it runs on.
* ``Driver``: the one way an owner performs a machine's actions: a table of action type ->
  the owner's function; ``step`` advances the holder's state and performs what came out.
* ``fold(transition, state, *events)``: the state after the events and every action, in
  order (tests, and a shell replaying events).

Extra positional arguments after the event (``context``: e.g. the breaker's configuration)
are passed to every handler unchanged.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping, Optional, TypeVar

S = TypeVar("S")
Result = tuple  # (state, list of actions)
Handler = Callable[..., Result]


class IllegalTransition(RuntimeError):
    """An event that is illegal in the machine's current state; the state is unchanged."""


def ignore(state: S, event: Any, *context: Any) -> Result:
    """A handler for events that change nothing (late replies after the end, duplicates)."""
    return state, []


IGNORE = ignore


def label(status: Any) -> str:
    """How a state's status reads in an error: a str enum's value, an int enum's name."""
    value = getattr(status, "value", status)
    return value if isinstance(value, str) else getattr(status, "name", str(status)).lower()


def _event_type(key) -> type:
    return key[1] if isinstance(key, tuple) else key


def table_machine(handlers: Mapping[Any, Handler], *, error: type[IllegalTransition] = IllegalTransition,
                  status: str = "phase", terminal: Collection = (), after_end: Optional[Mapping[type, Handler]] = None,
                  guard: Optional[Callable[[Any, Any], None]] = None, noun: str = "machine",
                  illegal: Optional[Callable[[Any, Any], str]] = None, actions: Any = ()) -> Callable[..., Result]:
    """A transition function over ``handlers``: ``(status, event type)`` or ``event type`` ->
    ``handler(state, event, *context)``.

    ``status`` names the state's attribute that says where the machine is. A pair's row is
    taken first, then the event type's; a known event with neither in the current status is
    illegal there (``illegal(state, event)`` words the error; by default "<event> while the
    <noun> is <status>"). While the status is one of ``terminal`` the machine has ended, and
    only a pair's row for that status or the events of ``after_end`` are legal (their handler
    runs: IGNORE for those that change nothing). ``guard(state, event)`` may raise ``error``
    before a live state's handler runs. Every illegal or unknown event raises ``error``;
    handlers raise it too for events illegal in the state they see. ``actions``: the machine's
    action types (a tuple, one class or a Union), read by ``Driver``.
    """
    table = dict(handlers)
    events = frozenset(_event_type(key) for key in table)
    by_status = any(isinstance(key, tuple) for key in table)  # else the status is read only at the end
    late = dict(after_end or {})
    ended = frozenset(terminal)
    if not set(late) <= events:
        unknown = sorted(t.__name__ for t in set(late) - events)
        raise ValueError(f"after_end lists events the table does not: {unknown}")

    def refuse(state, event) -> IllegalTransition:
        if illegal is not None:
            return error(illegal(state, event))
        return error(f"{type(event).__name__} while the {noun} is {label(getattr(state, status))}")

    def transition(state, event, *context) -> Result:
        kind = type(event)
        if kind not in events:
            raise error(f"unknown event {event!r}")
        where = getattr(state, status) if ended or by_status else None
        if ended and where in ended:
            handler = (by_status and table.get((where, kind))) or late.get(kind)
            if handler is None:
                raise error(f"{kind.__name__} after the {noun} ended ({label(where)})")
            return handler(state, event, *context)
        handler = (by_status and table.get((where, kind))) or table.get(kind)
        if guard is not None:
            guard(state, event)
        if handler is None:
            raise refuse(state, event)
        return handler(state, event, *context)

    transition.handlers = table  # for tests and docs: every (status, event) the machine knows
    transition.events = events
    transition.terminal = ended
    transition.actions = frozenset(typing.get_args(actions) or (actions if isinstance(actions, tuple) else (actions,)))
    return transition


@dataclass(frozen=True)
class TableRow:
    """One legal ``(status, event)`` pair of a machine: ``handler`` makes the move, to one of
    ``to`` (the statuses it may lead to, for the diagram and the tests that hold it to them);
    ``guard(state, event)``, where there is one, says why the event is illegal in this status
    after all (a string; None: it is legal). ``note`` says what the row does, in a few words."""
    status: Any
    event: type
    to: tuple
    handler: Handler
    guard: Optional[Callable[[Any, Any], Optional[str]]] = None
    note: str = ""


def _guarded(row: TableRow, error: type[IllegalTransition]) -> Handler:
    guard, handler = row.guard, row.handler

    def run(state, event, *context):
        why = guard(state, event)
        if why is not None:
            raise error(why)
        return handler(state, event, *context)

    run.row = row
    return run


def rows_table(rows: Iterable[TableRow], error: type[IllegalTransition] = IllegalTransition) -> dict:
    """``table_machine``'s handlers from ``rows``: each row's handler behind its guard. Two rows
    for one pair are a ``ValueError``."""
    table: dict = {}
    for row in rows:
        key = (row.status, row.event)
        if key in table:
            raise ValueError(f"two rows for ({label(row.status)}, {row.event.__name__})")
        table[key] = row.handler if row.guard is None else _guarded(row, error)
    return table


def _guard_words(row: TableRow) -> str:
    doc = (row.guard.__doc__ or row.guard.__name__) if row.guard is not None else ""
    return doc.strip().splitlines()[0].rstrip(".") if doc else ""


def diagram(rows: Iterable[TableRow], *, mermaid: bool = False) -> str:
    """The rows as a picture: one line a row, ``status --Event [guard]--> to | to: note``, or
    with ``mermaid`` a ``stateDiagram-v2`` with one arrow per (row, status it may lead to)."""
    rows = list(rows)
    if mermaid:
        lines = ["stateDiagram-v2"]
        for row in rows:
            guard = _guard_words(row)
            text = row.event.__name__ + (f" [{guard}]" if guard else "")
            lines += [f"    {label(row.status)} --> {label(to)}: {text}" for to in row.to]
        return "\n".join(lines) + "\n"
    width = max(len(label(row.status)) for row in rows)
    events = max(len(row.event.__name__) for row in rows)
    lines = []
    for row in rows:
        guard = _guard_words(row)
        to = " | ".join(label(t) for t in row.to)
        line = f"{label(row.status):<{width}}  {row.event.__name__:<{events}}  -> {to}"
        if guard:
            line += f"  [{guard}]"
        if row.note:
            line += f"  {row.note}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def nothing(holder: Any, action: Any, *about: Any) -> None:
    """A Driver's entry for an action its caller reads from ``step``'s answer instead."""


class Driver:
    """Performs one machine's actions for its owner: ``perform`` maps every action type the
    machine produces to a function ``(holder, action, *about)``; the holder keeps the state in
    its attribute ``state``.

    ``step(holder, event, *about)`` is the one way the state changes: the transition (with
    ``context``), the new state stored on the holder, then each action performed in order.
    ``advance`` and ``perform`` are its two halves, for an owner that must do something in
    between (drop its lock, yield the tokens an action returns). An owner holding many
    machines (rooms) passes each room as the holder; an owner that is the holder can list its
    own (unbound) methods. A machine built with ``actions`` is checked at once: an action the
    table lacks, or an entry for none, is a ``ValueError`` here, not a surprise at run time.
    """

    def __init__(self, transition: Callable[..., Result], perform: Mapping[type, Callable[..., Any]], *,
                 state: str = "state", context: tuple = ()):
        self.transition, self.state, self.context = transition, state, tuple(context)
        self.table = dict(perform)
        declared = getattr(transition, "actions", frozenset())
        if declared and set(self.table) != declared:
            missing = sorted(t.__name__ for t in declared - set(self.table))
            extra = sorted(t.__name__ for t in set(self.table) - declared)
            raise ValueError(f"the driver's table misses {missing} and has no such actions {extra}")

    def advance(self, holder: Any, event: Any) -> list:
        state, actions = self.transition(getattr(holder, self.state), event, *self.context)
        setattr(holder, self.state, state)
        return actions

    def perform(self, holder: Any, action: Any, *about: Any) -> Any:
        return self.table[type(action)](holder, action, *about)

    def step(self, holder: Any, event: Any, *about: Any) -> list:
        actions = self.advance(holder, event)
        for action in actions:
            self.perform(holder, action, *about)
        return actions


def fold(transition: Callable[..., Result], state: S, *events: Any, context: tuple = ()) -> tuple[S, list]:
    """``state`` after ``events`` in order, and every action they produced, in order."""
    actions: list = []
    for event in events:
        state, produced = transition(state, event, *context)
        actions += produced
    return state, actions
