"""Driving a pure state machine (``transition(state, event) -> (state, actions)``) in tests."""


def fold(transition, state, *events):
    """``state`` after ``events`` in order, and every action they produced, in order."""
    actions = []
    for event in events:
        state, produced = transition(state, event)
        actions += produced
    return state, actions
