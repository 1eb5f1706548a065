"""What a waiting stream hears of its model's state, from the states of its replicas."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from homelab_gateway.line.residency import waiting_state


def pool(state: str | None) -> Any:
    """A pool as `waiting_state` reads it: None is an always-loaded upstream."""
    return SimpleNamespace(resident=None if state is None else SimpleNamespace(state=state))


@pytest.mark.parametrize(
    ("states", "heard"),
    [
        (["unloaded"], "unloaded"),
        (["unloading"], "unloaded"),  # another model's turn: not loading for this waiter
        (["failed"], "unloaded"),
        (["loading"], "loading"),
        (["loaded"], None),  # loaded, only busy: a plain queue frame
        (["unloaded", "loading"], "loading"),
        (["unloaded", "loaded"], None),
        ([None, "unloaded"], None),  # an always-loaded replica serves the model
    ],
)
def test_a_waiter_hears_the_best_state_of_its_models_replicas(
    states: list[str | None], heard: str | None
) -> None:
    assert waiting_state([pool(s) for s in states]) == heard
