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
* ``table_machine(...)``: a transition function that dispatches on the event's type through
  a table of handlers, with the terminal states handled once: after the end, an event listed
  in ``after_end`` still goes to its handler (``IGNORE``: nothing changes), any other is
  illegal. A ``guard`` refuses events before the table sees them (e.g. anything but the
  first event in the first state).
* ``fold(transition, state, *events)``: the state after the events and every action, in
  order (tests, and a shell replaying events).

Extra positional arguments after the event (``context``: e.g. the breaker's configuration)
are passed to every handler unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, Optional, TypeVar

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


def table_machine(handlers: Mapping[type, Handler], *, error: type[IllegalTransition] = IllegalTransition,
                  status: str = "phase", terminal: Collection = (), after_end: Optional[Mapping[type, Handler]] = None,
                  guard: Optional[Callable[[Any, Any], None]] = None, noun: str = "machine") -> Callable[..., Result]:
    """A transition function over ``handlers`` (event type -> ``handler(state, event, *context)``).

    ``status`` names the state's attribute that says where the machine is; while it is one of
    ``terminal`` the machine has ended, and only the events of ``after_end`` are legal (their
    handler runs: IGNORE for those that change nothing). ``guard(state, event)`` may raise
    ``error`` before a live state's handler runs. Every illegal or unknown event raises
    ``error``; handlers raise it too for events illegal in the state they see.
    """
    table = dict(handlers)
    late = dict(after_end or {})
    ended = frozenset(terminal)
    if not set(late) <= set(table):
        unknown = sorted(t.__name__ for t in set(late) - set(table))
        raise ValueError(f"after_end lists events the table does not: {unknown}")

    def transition(state, event, *context) -> Result:
        kind = type(event)
        if ended and getattr(state, status) in ended:
            handler = late.get(kind)
            if handler is None:
                if kind not in table:
                    raise error(f"unknown event {event!r}")
                raise error(f"{kind.__name__} after the {noun} ended ({label(getattr(state, status))})")
            return handler(state, event, *context)
        handler = table.get(kind)
        if handler is None:
            raise error(f"unknown event {event!r}")
        if guard is not None:
            guard(state, event)
        return handler(state, event, *context)

    transition.handlers = table  # for tests and docs: every event the machine knows
    transition.terminal = ended
    return transition


def fold(transition: Callable[..., Result], state: S, *events: Any, context: tuple = ()) -> tuple[S, list]:
    """``state`` after ``events`` in order, and every action they produced, in order."""
    actions: list = []
    for event in events:
        state, produced = transition(state, event, *context)
        actions += produced
    return state, actions
