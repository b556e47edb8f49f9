"""Flow-level network: max-min sharing by hand, latency, collectives vs the alpha-beta model
(each test with the agenda entries applied in C, `_agenda_entries`, where it was built, and in
Python)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import simpy

from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.sim.collectives import p2p, ring_collective
from holmes_sim.sim.environment import CountingEnvironment
from holmes_sim.sim import agenda_entries, network
from holmes_sim.sim.network import FlowNetwork, PathUse

C = 1e10  # bytes/s
N = 4e9  # bytes


@pytest.fixture(autouse=True, params=["built", "python"])
def apply_entries(request, monkeypatch):
    """What `FlowNetwork._on_wake` applies agenda entries with and `send_message` posts flows
    with: the built ones or Python's."""
    if request.param == "python":
        monkeypatch.setattr(network, "apply", agenda_entries._apply)
        monkeypatch.setattr(network, "post", None)
    elif network.apply is agenda_entries._apply:
        pytest.skip("the C agenda entries were not built")


def one(link: object) -> PathUse:
    return ((link, 1.0),)


def run_transfers(
    caps: dict, specs: Sequence[tuple[float, PathUse, float, float]]
) -> tuple[list[float], FlowNetwork]:
    """Start transfer k at specs[k][0] seconds; return each one's completion time."""
    env = simpy.Environment()
    net = FlowNetwork(env, caps)
    ends = [float("nan")] * len(specs)

    def sender(k: int, start: float, path: PathUse, size: float, latency: float):
        yield env.timeout(start)
        yield net.transfer(path, size, latency)
        ends[k] = env.now

    for k, spec in enumerate(specs):
        env.process(sender(k, *spec))
    env.run()
    return ends, net


def rates_at(caps: dict, paths: Sequence[PathUse], at: float = 1e-6) -> list[float]:
    """Rates of flows that all start at 0 (huge sizes), sampled at `at` seconds."""
    env = simpy.Environment()
    net = FlowNetwork(env, caps)
    handles = [net.transfer(p, 1e18) for p in paths]
    env.run(until=at)
    return [net.current_rate(h) for h in handles]


def test_two_equal_flows_share_one_link_equally() -> None:
    ends, net = run_transfers({"l": C}, [(0.0, one("l"), N, 0.0)] * 2)
    assert ends == [pytest.approx(2 * N / C, rel=1e-12)] * 2
    assert rates_at({"l": C}, [one("l")] * 2) == [C / 2, C / 2]
    assert net.flows_started == 2 and net.active_flows == 0


def test_flow_joined_midway_has_piecewise_timing() -> None:
    # Flow 0 alone for N/(2C) (half done), then shares: ends at N/(2C) + (N/2)/(C/2) = 1.5 N/C.
    # Flow 1 has moved N/2 by then and finishes alone at full rate: 2 N/C.
    t1 = N / (2 * C)
    ends, _ = run_transfers({"l": C}, [(0.0, one("l"), N, 0.0), (t1, one("l"), N, 0.0)])
    assert ends[0] == pytest.approx(1.5 * N / C, rel=1e-12)
    assert ends[1] == pytest.approx(2.0 * N / C, rel=1e-12)


def test_rates_follow_joins_and_departures() -> None:
    env = simpy.Environment()
    net = FlowNetwork(env, {"l": C})
    a = net.transfer(one("l"), N)
    env.run(until=0.1)
    assert net.current_rate(a) == C
    b = net.transfer(one("l"), N)
    env.run(until=0.2)
    assert net.current_rate(a) == net.current_rate(b) == C / 2
    env.run(until=a)
    assert net.current_rate(a) == 0.0 and net.current_rate(b) == C
    assert net.active_flows == 1


def test_weighted_flow_over_two_nics_vs_flow_on_one() -> None:
    # A spreads over L1 and L2 (weight 0.5 each), B uses L1. Both rise at r until L1 holds
    # 0.5 r + r = C, i.e. r = 2C/3; L2 then carries only C/3.
    caps = {"l1": C, "l2": C}
    spread = (("l1", 0.5), ("l2", 0.5))
    assert rates_at(caps, [spread, one("l1")]) == pytest.approx([2 * C / 3, 2 * C / 3])
    # Alone, the spread flow gets both NICs: 0.5 r <= C on each, r = 2C.
    assert rates_at(caps, [spread]) == [2 * C]


def test_weighted_flow_bottlenecked_on_its_slow_nic() -> None:
    # L1 = 10, L2 = 2. L2 saturates first at 0.5 r = 2, so A = 4; B then takes what A leaves
    # on L1: 10 - 0.5 * 4 = 8.
    caps = {"l1": 10.0, "l2": 2.0}
    assert rates_at(caps, [(("l1", 0.5), ("l2", 0.5)), one("l1")]) == pytest.approx([4.0, 8.0])


def test_textbook_max_min_three_links_four_flows() -> None:
    # Links L1 = 12, L2 = 8, L3 = 6. f1: L1+L2, f2: L2+L3, f3: L1, f4: L3.
    # Level 3: L3 saturates (f2, f4 at 3). L2 has 8 - 3 = 5 left for f1 -> f1 = 5.
    # L1 has 12 - 5 = 7 left for f3 -> f3 = 7.
    caps = {"L1": 12.0, "L2": 8.0, "L3": 6.0}
    paths = [
        (("L1", 1.0), ("L2", 1.0)),
        (("L2", 1.0), ("L3", 1.0)),
        one("L1"),
        one("L3"),
    ]
    assert rates_at(caps, paths) == pytest.approx([5.0, 3.0, 7.0, 3.0], rel=1e-12)


def test_latency_is_paid_before_the_bytes() -> None:
    lat = N / (2 * C)
    ends, _ = run_transfers({"l": C}, [(0.0, one("l"), N, lat)])
    assert ends[0] == pytest.approx(lat + N / C, rel=1e-12)
    # During its latency a flow does not load the link: flow 0 runs alone at C for `lat`.
    ends, _ = run_transfers({"l": C}, [(0.0, one("l"), N, 0.0), (0.0, one("l"), N, lat)])
    assert ends == pytest.approx([1.5 * N / C, 2.0 * N / C], rel=1e-12)


def test_zero_size_and_empty_path_take_the_latency_only() -> None:
    ends, net = run_transfers(
        {"l": C}, [(1.0, one("l"), 0.0, 2e-6), (1.0, (), N, 3e-6), (1.0, one("l"), 0.0, 0.0)]
    )
    assert ends == [1.0 + 2e-6, 1.0 + 3e-6, 1.0]
    assert net.flows_started == 0


def test_repeated_link_in_path_adds_weights() -> None:
    assert rates_at({"l": C}, [(("l", 1.0), ("l", 1.0))]) == [C / 2]


def test_unknown_link_and_bad_arguments_raise() -> None:
    env = simpy.Environment()
    net = FlowNetwork(env, {"l": C})
    with pytest.raises(KeyError, match="nowhere"):
        net.transfer(one("nowhere"), N)
    with pytest.raises(ValueError):
        net.transfer((("l", 0.0),), N)
    with pytest.raises(ValueError):
        net.transfer(one("l"), -1.0)
    with pytest.raises(ValueError):
        FlowNetwork(env, {"l": 0.0})


def test_simultaneous_finishers_retire_in_one_recomputation() -> None:
    # Cap 3: sizes 1, 2, 2 start together at rate 1 each (one recomputation). At t = 1 flow 0
    # ends (another); flows 1 and 2 then have 1 byte left at rate 1.5 and finish together at
    # 1 + 2/3, which needs no recomputation since nothing is left on the link.
    ends, net = run_transfers({"l": 3.0}, [(0.0, one("l"), s, 0.0) for s in (1.0, 2.0, 2.0)])
    assert ends[0] == pytest.approx(1.0)
    assert ends[1] == ends[2] == pytest.approx(1.0 + 2.0 / 3.0, rel=1e-12)
    assert net.rate_recomputations == 2


def test_float_drift_does_not_split_a_common_finish() -> None:
    # Flow 0 runs alone for N/(2C), then shares with flow 1 of N/2 bytes: both end at 1.5 N/C
    # exactly in real numbers. Rounding must not split that into two nearby instants.
    rng = random.Random(3)
    for _ in range(100):
        cap, size, start = rng.uniform(1e9, 5e10), rng.uniform(1e6, 1e9), rng.uniform(0, 10)
        specs = [(start, one("l"), size, 0.0), (start + size / (2 * cap), one("l"), size / 2, 0.0)]
        ends, _ = run_transfers({"l": cap}, specs)
        assert ends[0] == ends[1] == pytest.approx(start + 1.5 * size / cap, rel=1e-12)


def test_independent_flows_are_not_rescheduled() -> None:
    # Flows on disjoint links never disturb each other, whatever else starts.
    specs = [(0.0, one("a"), N, 0.0)] + [(0.01 * k, one("b"), 1e7, 0.0) for k in range(20)]
    ends, _ = run_transfers({"a": C, "b": C}, specs)
    assert ends[0] == N / C


# -- collectives -----------------------------------------------------------------------


def ring_network(p: int, bw: float, rails: int = 1) -> tuple[dict, list[PathUse]]:
    """p nodes, each with `rails` NICs of bw / rails; hop i spreads over all rails evenly."""
    caps: dict = {}
    for node in range(p):
        for r in range(rails):
            caps[("nic", node, r, "tx")] = bw / rails
            caps[("nic", node, r, "rx")] = bw / rails
    w = 1.0 / rails
    hops = [
        tuple((("nic", i, r, "tx"), w) for r in range(rails))
        + tuple((("nic", (i + 1) % p, r, "rx"), w) for r in range(rails))
        for i in range(p)
    ]
    return caps, hops


def run_ring(caps: dict, hops: list[PathUse], kind: str, size: float, lat: float,
             step_by_step: bool) -> float:
    env = simpy.Environment()
    net = FlowNetwork(env, caps)
    env.process(ring_collective(env, net, kind, hops, size, lat, step_by_step))
    env.run()
    assert net.active_flows == 0
    return env.now


@pytest.mark.parametrize("step_by_step", [False, True])
@pytest.mark.parametrize("p", [2, 3, 8])
@pytest.mark.parametrize("kind", ["all-reduce", "reduce-scatter", "all-gather"])
@pytest.mark.parametrize("rails", [1, 2])
def test_idle_ring_matches_alpha_beta(kind: str, p: int, step_by_step: bool, rails: int) -> None:
    bw, size, lat = 2.5e10, 3.7e8, 7e-6
    caps, hops = ring_network(p, bw, rails)
    got = run_ring(caps, hops, kind, size, lat, step_by_step)
    want = ring_collective_time_s(kind, p, size, bw, lat)
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("step_by_step", [False, True])
@pytest.mark.parametrize("kind", ["all-reduce", "all-gather"])
def test_ring_with_one_slow_hop_runs_at_the_slow_speed(kind: str, step_by_step: bool) -> None:
    # An RDMA ring (bw each) whose hop 2 -> 3 crosses a 10x slower Ethernet link.
    p, bw, size, lat = 4, 5e10, 1e9, 5e-6
    caps, hops = ring_network(p, bw)
    caps["eth"] = bw / 10
    hops[2] = hops[2] + (("eth", 1.0),)
    got = run_ring(caps, hops, kind, size, lat, step_by_step)
    assert got == pytest.approx(ring_collective_time_s(kind, p, size, bw / 10, lat), rel=1e-9)
    assert got > 5 * ring_collective_time_s(kind, p, size, bw, lat)


def test_single_member_ring_returns_immediately() -> None:
    caps, hops = ring_network(1, C)
    assert run_ring(caps, hops, "all-reduce", N, 1e-5, False) == 0.0
    assert run_ring(caps, hops, "all-reduce", N, 1e-5, True) == 0.0


def test_ring_checks_its_kind_when_called() -> None:
    env = simpy.Environment()
    caps, hops = ring_network(2, C)
    with pytest.raises(ValueError):
        ring_collective(env, FlowNetwork(env, caps), "broadcast", hops, N, 0.0)


def test_p2p_wrapper() -> None:
    env = simpy.Environment()
    net = FlowNetwork(env, {"l": C})
    env.run(until=p2p(net, one("l"), N, 1e-5))
    assert env.now == pytest.approx(1e-5 + N / C, rel=1e-12)


# -- randomized: determinism and the max-min property ------------------------------------


def random_specs(seed: int, count: int = 300, nodes: int = 16):
    rng = random.Random(seed)
    caps: dict = {("up",): 4e10}
    for n in range(nodes):
        for r in range(2):
            caps[("nic", n, r, "tx")] = rng.choice([1.25e10, 2.5e10, 5e10])
            caps[("nic", n, r, "rx")] = caps[("nic", n, r, "tx")]
    specs = []
    for _ in range(count):
        src, dst = rng.sample(range(nodes), 2)
        if rng.random() < 0.5:
            path = ((("nic", src, 0, "tx"), 0.5), (("nic", src, 1, "tx"), 0.5),
                    (("nic", dst, 0, "rx"), 0.5), (("nic", dst, 1, "rx"), 0.5))
        else:
            r = rng.randrange(2)
            path = ((("nic", src, r, "tx"), 1.0), (("nic", dst, r, "rx"), 1.0))
        if rng.random() < 0.2:
            path = path + ((("up",), 1.0),)
        specs.append((rng.uniform(0, 0.5), path, rng.uniform(1e7, 1e9), rng.uniform(0, 1e-5)))
    return caps, specs


def test_same_calls_give_identical_timings() -> None:
    caps, specs = random_specs(7)
    first, net1 = run_transfers(caps, specs)
    second, net2 = run_transfers(caps, specs)
    assert first == second
    assert net1.rate_recomputations == net2.rate_recomputations
    assert all(e > s for e, (s, *_rest) in zip(first, specs, strict=True))


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_random_allocation_is_feasible_and_max_min_fair(seed: int) -> None:
    # Feasible and every flow has a bottleneck (a saturated link where no flow is faster):
    # together these characterize the max-min fair allocation (Bertsekas and Gallager 6.5.2).
    caps, specs = random_specs(seed, count=300)
    env = simpy.Environment()
    net = FlowNetwork(env, caps)
    handles: list = [None] * len(specs)

    def sender(k: int, start: float, path: PathUse, size: float, latency: float):
        yield env.timeout(start)
        handles[k] = net.transfer(path, size, latency)

    for k, spec in enumerate(specs):
        env.process(sender(k, *spec))
    checked = 0
    for at in [0.011 * i + 0.0071 for i in range(60)]:
        env.run(until=at)
        active = [(specs[k][1], net.current_rate(h)) for k, h in enumerate(handles)
                  if h is not None and net.current_rate(h) > 0]
        assert len(active) == net.active_flows
        load = dict.fromkeys(caps, 0.0)
        for path, rate in active:
            for link, w in path:
                load[link] += w * rate
        for link, used in load.items():
            assert used <= caps[link] * (1 + 1e-9)
        for path, rate in active:
            assert any(
                load[link] >= caps[link] * (1 - 1e-9)
                and all(r2 <= rate * (1 + 1e-9) for p2, r2 in active
                        if any(l2 == link for l2, _ in p2))
                for link, _ in path
            )
            checked += 1
    assert checked > 300


def test_no_rate_during_latency_and_counters() -> None:
    env = simpy.Environment()
    net = FlowNetwork(env, {"l": C})
    ev = net.transfer(one("l"), N, 1e-3)
    env.run(until=5e-4)
    assert net.current_rate(ev) == 0.0 and net.active_flows == 0 and net.flows_started == 0
    env.run(until=2e-3)
    assert net.current_rate(ev) == C and net.active_flows == 1 and net.flows_started == 1
    env.run(until=ev)
    assert env.now == pytest.approx(1e-3 + N / C, rel=1e-12) and net.active_flows == 0


def test_paths_given_as_lists_work() -> None:
    env = simpy.Environment()
    net = FlowNetwork(env, {"a": C, "b": C / 4})
    env.run(until=net.transfer([["a", 1.0], ["b", 1.0]], N))  # type: ignore[arg-type]
    assert env.now == pytest.approx(4 * N / C, rel=1e-12)


def test_send_message_flow_is_its_own_event() -> None:
    # A message's flow calls the shared callbacks with itself, carrying its message; a second
    # flow on a route sharing one link with it (not the same route) halves its rate.
    env = CountingEnvironment()
    net = FlowNetwork(env, {"a": C, "s": C, "b": C})
    got: list = []
    callbacks = [lambda flow: got.append((env.now, flow.message))]
    left = net.resolve((("a", 1.0), ("s", 1.0)))
    right = net.resolve((("s", 1.0), ("b", 1.0)))
    net.send_message(left, N, 0.0, callbacks, "first")
    env.run_until(env.timeout(N / C / 2))
    net.send_message(right, N, 0.0, callbacks, "second")
    env.run_until(env.timeout(2 * N / C))
    assert [m for _, m in got] == ["first", "second"]
    # first: half its bytes alone, the other half at C/2; second: N/2 at C/2, then alone
    assert got[0][0] == pytest.approx(1.5 * N / C, rel=1e-12)
    assert got[1][0] == pytest.approx(2.0 * N / C, rel=1e-12)
    assert net.active_flows == 0 and net.flows_started == 2
