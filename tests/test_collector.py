"""The collector settings the daemon applies once start-up is done."""

from __future__ import annotations

import gc

from homelab_gateway.collector import THRESHOLDS, tune_collector


def test_start_up_objects_are_frozen_and_collections_are_rarer() -> None:
    before = gc.get_threshold()
    try:
        tune_collector()
        assert gc.get_freeze_count() > 0  # start-up's objects are out of every collection
        assert gc.get_threshold() == THRESHOLDS
        assert THRESHOLDS[0] > before[0] and THRESHOLDS[2] > before[2]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
