"""Hand-computed checks of the alpha-beta ring and point-to-point costs."""

import math

import pytest

from holmes_sim.cost.collectives import (
    p2p_time_s,
    ring_collective_time_s,
    ring_latency_steps,
    ring_traffic_factor,
)


def test_all_reduce_p4_by_hand() -> None:
    # 2(p-1) alpha = 6 * 1e-5; 2(p-1)/p * N / B = 1.5 * 1e9 / 1e10 = 0.15
    t = ring_collective_time_s("all-reduce", 4, 1e9, 1e10, 1e-5)
    assert t == pytest.approx(6e-5 + 1.5e-1, rel=1e-12)


def test_reduce_scatter_and_all_gather_p4_by_hand() -> None:
    # (p-1) alpha = 3e-5; (p-1)/p * N / B = 0.75 * 0.1 = 0.075
    for kind in ("reduce-scatter", "all-gather"):
        t = ring_collective_time_s(kind, 4, 1e9, 1e10, 1e-5)
        assert t == pytest.approx(3e-5 + 7.5e-2, rel=1e-12)


def test_all_reduce_is_reduce_scatter_plus_all_gather() -> None:
    args = (7, 3.3e8, 2.5e10, 4e-6)
    total = ring_collective_time_s("reduce-scatter", *args)
    total += ring_collective_time_s("all-gather", *args)
    assert ring_collective_time_s("all-reduce", *args) == pytest.approx(total, rel=1e-12)


def test_single_member_costs_nothing() -> None:
    for kind in ("all-reduce", "reduce-scatter", "all-gather"):
        assert ring_collective_time_s(kind, 1, 1e9, 1e10, 1e-5) == 0.0
        assert ring_traffic_factor(kind, 1) == 0.0
        assert ring_latency_steps(kind, 1) == 0


def test_steps_and_traffic_factors() -> None:
    assert ring_latency_steps("all-reduce", 8) == 14
    assert ring_latency_steps("all-gather", 8) == 7
    assert ring_latency_steps("reduce-scatter", 2) == 1
    assert ring_traffic_factor("all-reduce", 8) == pytest.approx(1.75)
    assert ring_traffic_factor("all-gather", 8) == pytest.approx(0.875)
    assert ring_traffic_factor("reduce-scatter", 2) == pytest.approx(0.5)


def test_p2p_by_hand() -> None:
    assert p2p_time_s(2e6, 1e9, 3e-6) == pytest.approx(3e-6 + 2e-3, rel=1e-12)
    assert p2p_time_s(0, 1e9, 3e-6) == pytest.approx(3e-6)


def test_large_ring_bandwidth_term_tends_to_twice_n_over_b() -> None:
    t = ring_collective_time_s("all-reduce", 1024, 1e9, 1e10, 0.0)
    assert t == pytest.approx(2 * 1023 / 1024 * 0.1, rel=1e-12)
    assert math.isclose(t, 0.2, rel_tol=1e-3)


@pytest.mark.parametrize("kind", ["broadcast", "allreduce", ""])
def test_unknown_kind_raises(kind: str) -> None:
    with pytest.raises(ValueError, match="unknown collective kind"):
        ring_collective_time_s(kind, 4, 1e9, 1e10, 1e-5)
    with pytest.raises(ValueError):
        ring_traffic_factor(kind, 4)
    with pytest.raises(ValueError):
        ring_latency_steps(kind, 4)


def test_bad_member_count_and_bandwidth_raise() -> None:
    with pytest.raises(ValueError):
        ring_collective_time_s("all-reduce", 0, 1e9, 1e10, 1e-5)
    with pytest.raises(ValueError):
        ring_collective_time_s("all-reduce", 4, 1e9, 0.0, 1e-5)
    with pytest.raises(ValueError):
        p2p_time_s(1e9, -1.0, 0.0)
