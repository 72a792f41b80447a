"""The machine kit (sglang_pdd/machine.py), and every state machine of the package built on it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import pytest

from sglang_pdd.machine import IGNORE, Driver, IllegalTransition, TableRow, diagram, fold, nothing, rows_table, table_machine


class Light(str, enum.Enum):
    OFF = "off"
    ON = "on"
    BROKEN = "broken"


@dataclass(frozen=True)
class Lamp:
    phase: Light = Light.OFF
    switched: int = 0


@dataclass(frozen=True)
class Switch:
    pass


@dataclass(frozen=True)
class Smash:
    pass


@dataclass(frozen=True)
class Look:
    pass


class IllegalLampEvent(IllegalTransition):
    pass


def _switch(s: Lamp, e: Switch, step: int = 1):
    return replace(s, phase=Light.ON if s.phase is Light.OFF else Light.OFF, switched=s.switched + step), ["click"]


def _smash(s: Lamp, e: Smash, step: int = 1):
    return replace(s, phase=Light.BROKEN), ["crash"]


def _guard(s: Lamp, e) -> None:
    if s.phase is Light.OFF and type(e) is Smash:
        raise IllegalLampEvent("smashed in the dark")


lamp = table_machine({Switch: _switch, Smash: _smash, Look: IGNORE}, error=IllegalLampEvent,
                     terminal=(Light.BROKEN,), after_end={Look: IGNORE, Switch: lambda s, e, *c: (s, ["nothing"])},
                     guard=_guard, noun="lamp")


def test_dispatch_by_event_type_and_fold_collects_every_action_in_order():
    state, actions = fold(lamp, Lamp(), Switch(), Look(), Switch(), Switch(), Smash())
    assert state == Lamp(Light.BROKEN, switched=3)
    assert actions == ["click", "click", "click", "crash"]


def test_context_goes_to_every_handler():
    state, _ = fold(lamp, Lamp(), Switch(), Switch(), context=(5,))
    assert state.switched == 10


def test_after_the_end_only_listed_events_run_and_others_are_illegal():
    broken, _ = fold(lamp, Lamp(), Switch(), Smash())
    assert lamp(broken, Look()) == (broken, [])
    assert lamp(broken, Switch()) == (broken, ["nothing"])
    with pytest.raises(IllegalLampEvent, match=r"Smash after the lamp ended \(broken\)"):
        lamp(broken, Smash())


def test_unknown_events_and_guarded_ones_raise_the_machines_error_on_the_one_base():
    with pytest.raises(IllegalLampEvent, match="unknown event"):
        lamp(Lamp(), "switch")
    with pytest.raises(IllegalTransition, match="smashed in the dark"):
        lamp(Lamp(), Smash())


def test_after_end_must_name_events_of_the_table():
    with pytest.raises(ValueError, match="Look"):
        table_machine({Switch: _switch}, terminal=(Light.BROKEN,), after_end={Look: IGNORE})


# A lamp whose table is keyed by (phase, event): switching on is legal only when it is off.
@dataclass(frozen=True)
class TurnOn:
    pass


@dataclass(frozen=True)
class Glow:
    """An action: light the room."""


@dataclass(frozen=True)
class Tick:
    """An action: count a switch."""


def _turn_on(s: Lamp, e: TurnOn):
    return replace(s, phase=Light.ON), [Tick(), Glow()]


strict = table_machine({(Light.OFF, TurnOn): _turn_on, (Light.ON, Switch): _switch, Look: IGNORE},
                       error=IllegalLampEvent, terminal=(Light.BROKEN,), noun="lamp", actions=(Glow, Tick))


def test_a_pair_runs_in_its_state_only_and_a_missing_pair_is_illegal_there():
    on, actions = strict(Lamp(), TurnOn())
    assert on.phase is Light.ON and actions == [Tick(), Glow()]
    assert strict(on, Look()) == (on, [])  # keyed by the event alone: in every live state
    with pytest.raises(IllegalLampEvent, match="TurnOn while the lamp is on"):
        strict(on, TurnOn())
    with pytest.raises(IllegalLampEvent, match="Switch while the lamp is off"):
        strict(Lamp(), Switch())
    with pytest.raises(IllegalLampEvent, match="unknown event"):
        strict(Lamp(), Smash())


class Room:
    def __init__(self):
        self.state = Lamp()
        self.seen: list = []


def test_the_driver_stores_the_state_before_it_performs_each_action_in_order():
    def glow(room, action, why):
        room.seen.append(("glow", room.state.phase, why))

    def tick(room, action, why):
        room.seen.append(("tick", room.state.phase, why))

    driver = Driver(strict, {Glow: glow, Tick: tick})
    room = Room()
    assert driver.step(room, TurnOn(), "dusk") == [Tick(), Glow()]
    assert room.state.phase is Light.ON
    assert room.seen == [("tick", Light.ON, "dusk"), ("glow", Light.ON, "dusk")]
    with pytest.raises(IllegalLampEvent):
        driver.step(room, TurnOn(), "again")
    assert room.state.phase is Light.ON and len(room.seen) == 2  # refused: nothing changed or ran


def test_the_driver_keeps_the_state_where_it_is_told_and_advance_performs_nothing():
    class Owner:
        lamp = Lamp()

    driver = Driver(strict, {Glow: nothing, Tick: nothing}, state="lamp")
    owner = Owner()
    assert driver.advance(owner, TurnOn()) == [Tick(), Glow()]
    assert owner.lamp.phase is Light.ON


def test_a_driver_must_perform_every_action_of_its_machine_and_no_other():
    with pytest.raises(ValueError, match=r"misses \['Tick'\]"):
        Driver(strict, {Glow: nothing})
    with pytest.raises(ValueError, match=r"no such actions \['TurnOn'\]"):
        Driver(strict, {Glow: nothing, Tick: nothing, TurnOn: nothing})


def _machines():
    """Every state machine of the package: (its transition, a state, extra arguments)."""
    from sglang_pdd.kv_channel import handshake_slot, recv_room, send_room
    from sglang_pdd.sglang_glue.p import fanout_room
    from sglang_pdd.sglang_glue.p import wan_binding
    from sglang_pdd.radix_drc import room_state
    from sglang_pdd.router.backends import health
    from sglang_pdd.router.flow import lifecycle
    return {
        "router/lifecycle": (lifecycle.transition, lifecycle.RequestState(max_new=4), ()),
        "radix_drc/room_state": (room_state.transition, room_state.DrcState(), ()),
        "kv_channel/send_room": (send_room.transition, send_room.start(1, 10, True), ()),
        "sglang_glue/p/fanout_room": (fanout_room.transition, fanout_room.FanoutState(shares=1), ()),
        "sglang_glue/p/wan_binding": (wan_binding.transition, wan_binding.bound(None), ()),
        "router/health": (health.transition, health.BreakerState(), (health.HealthConfig(),)),
        "kv_channel/recv_room": (recv_room.transition, recv_room.RecvState(), ()),
        "kv_channel/handshake_slot": (handshake_slot.transition, handshake_slot.SlotState(1.0), ()),
    }


@pytest.mark.parametrize("name", sorted(_machines()))
def test_every_machine_refuses_an_unknown_event_with_the_kits_error(name):
    transition, state, context = _machines()[name]
    assert transition.handlers  # built by the kit: its table is there to read
    with pytest.raises(IllegalTransition, match="unknown event"):
        transition(state, object(), *context)


# ------------------------------------------------------------------------------ rows
def _lit(s: Lamp, e) -> str | None:
    """switched fewer than twice"""
    return "worn out" if s.switched >= 2 else None


_ROWS = (
    TableRow(Light.OFF, Switch, (Light.ON,), _switch, _lit, "light"),
    TableRow(Light.ON, Switch, (Light.OFF,), _switch),
    TableRow(Light.ON, Smash, (Light.BROKEN,), _smash),
    TableRow(Light.BROKEN, Look, (Light.BROKEN,), IGNORE),
)
rowed = table_machine(rows_table(_ROWS, IllegalLampEvent), error=IllegalLampEvent, terminal=(Light.BROKEN,),
                      noun="lamp")


def test_rows_run_their_handler_behind_their_guard():
    assert rowed(Lamp(), Switch()) == (Lamp(Light.ON, 1), ["click"])
    worn = Lamp(Light.OFF, switched=2)
    with pytest.raises(IllegalLampEvent, match="worn out"):
        rowed(worn, Switch())
    with pytest.raises(IllegalLampEvent, match="Smash while the lamp is off"):  # no row: illegal
        rowed(Lamp(), Smash())


def test_after_the_end_a_pair_row_of_the_terminal_status_runs_and_nothing_else():
    broken = Lamp(Light.BROKEN)
    assert rowed(broken, Look()) == (broken, [])
    with pytest.raises(IllegalLampEvent, match=r"Switch after the lamp ended \(broken\)"):
        rowed(broken, Switch())


def test_two_rows_for_one_pair_are_refused():
    with pytest.raises(ValueError, match=r"two rows for \(on, Smash\)"):
        rows_table(_ROWS + (TableRow(Light.ON, Smash, (Light.OFF,), _smash),))


def test_the_diagram_prints_each_row_with_its_guard_and_where_it_leads():
    assert diagram(_ROWS).splitlines() == [
        "off     Switch  -> on  [switched fewer than twice]  light",
        "on      Switch  -> off",
        "on      Smash   -> broken",
        "broken  Look    -> broken",
    ]
    assert diagram(_ROWS, mermaid=True).splitlines() == [
        "stateDiagram-v2",
        "    off --> on: Switch [switched fewer than twice]",
        "    on --> off: Switch",
        "    on --> broken: Smash",
        "    broken --> broken: Look",
    ]
