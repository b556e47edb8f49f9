"""quiet_collector: objects frozen out of collection once however deep the nesting, thresholds
set and restored, collection kept off inside a context that turned it off."""

from __future__ import annotations

import gc

import pytest

from holmes_sim.collector import frozen, quiet_collector


@pytest.fixture(autouse=True)
def _unfrozen():
    assert gc.get_freeze_count() == 0 and not frozen()
    old = gc.get_threshold()
    yield
    gc.set_threshold(*old)


def test_freezes_sets_the_threshold_and_restores_both():
    old = gc.get_threshold()
    with quiet_collector():
        assert frozen() and gc.get_freeze_count() > 0
        assert gc.get_threshold() == (200_000, old[1], old[2])
    assert gc.get_threshold() == old
    assert gc.get_freeze_count() == 0 and not frozen()


def test_an_inner_context_leaves_the_outer_freeze_and_off_switch_alone():
    old = gc.get_threshold()
    with quiet_collector(threshold=0):
        count = gc.get_freeze_count()
        with quiet_collector():
            assert gc.get_threshold()[0] == 0  # off stays off
            assert gc.get_freeze_count() == count  # no second freeze
        assert frozen() and gc.get_freeze_count() == count  # the inner did not unfreeze
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold() == old and gc.get_freeze_count() == 0


def test_restores_after_an_error():
    old = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with quiet_collector():
            raise RuntimeError("boom")
    assert gc.get_threshold() == old and gc.get_freeze_count() == 0 and not frozen()


def test_a_callers_own_freeze_is_seen_and_kept():
    gc.freeze()
    try:
        assert frozen()
        with quiet_collector():
            pass
        assert gc.get_freeze_count() > 0  # not unfrozen by the context
    finally:
        gc.unfreeze()


def test_objects_made_inside_join_the_frozen_ones_and_leave_with_them():
    with quiet_collector(threshold=0):
        before = gc.get_freeze_count()
        with quiet_collector(freeze_made=True):
            made = [[i] for i in range(1000)]
        assert gc.get_freeze_count() >= before + len(made)  # frozen with the outer's objects
    assert gc.get_freeze_count() == 0  # the outer context unfroze them all
    with quiet_collector(freeze_made=True):
        made = [[i] for i in range(1000)]
        inside = gc.get_freeze_count()
    assert gc.get_freeze_count() == 0 and inside > 0


def test_nothing_is_frozen_after_an_error_inside():
    with quiet_collector(threshold=0):
        before = gc.get_freeze_count()
        with pytest.raises(RuntimeError):
            with quiet_collector(freeze_made=True):
                made = [[i] for i in range(1000)]
                raise RuntimeError(f"boom after {len(made)} objects")
        assert gc.get_freeze_count() == before
