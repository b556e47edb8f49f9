"""Flow-level network: weighted max-min fair bandwidth sharing between concurrent flows.

Model (fluid flows, as in flow-level simulators such as SimGrid; Bertsekas and Gallager,
"Data Networks", 2nd ed., section 6.5.2, max-min fairness by progressive filling):

- each link l has a capacity C_l in bytes/s; each active flow f has a rate r_f in bytes/s and
  loads link l with w_{f,l} * r_f, subject to sum_f w_{f,l} * r_f <= C_l;
- the rates are the weighted max-min fair allocation: all unfrozen flows rise at the same rate;
  when a link saturates, the flows crossing it freeze at the current level;
- rates are recomputed whenever flows start or end, and only where they can change: first for
  the flows on the touched links, keeping every other rate, then (if that result is not max-min
  fair as a whole) for wider regions, and at worst for the connected components of flows that
  share links with them; flows whose rate does not change keep their scheduled completion;
- a transfer first pays its latency (seconds), then its bytes move at the flow's rate.

A weight below 1 models a group of GPUs sending one logical flow over several NICs: a flow
spread over 2 NICs puts weight 0.5 on each NIC's link, so a rate r loads each NIC with r / 2.

Mechanics: the network keeps its own agenda (a heap of flow starts and predicted completions)
and arms one SimPy wake-up per distinct due time it needs. All starts and completions due at
one instant are applied together and followed by one recomputation; a flow that starts alone
on all its links skips it. An entry made stale by a rate change stays in the heap and is
skipped when it surfaces. A flow within 1e-9 of its size (or 1e-13 of the clock) of its last
byte when rates are recomputed finishes then, so rounding does not split a common finish.

Determinism: flows get a monotonically increasing id, agenda entries a sequence number, links
an index in the order of the capacities mapping; every decision iterates lists or
insertion-ordered dicts.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Hashable, Mapping
from typing import Any

import simpy
from simpy.events import NORMAL

from holmes_sim.sim.agenda_entries import apply, post
from holmes_sim.sim.flow_records import ACTIVE, DONE, PENDING, Flow, Route
from holmes_sim.sim.progressive_filling import ProgressiveFilling

LinkId = Hashable
PathUse = tuple[tuple[LinkId, float], ...]

# A flow is finished when its remaining bytes fall below this share of its size ...
_REL_EPS_BYTES = 1e-9
# ... or would take less than this share of the current simulated time to drain.
_REL_EPS_TIME = 1e-13
# Rate changes smaller than this (relative) keep the flow's scheduled completion.
_REL_EPS_RATE = 1e-12
# Slack when checking that a local re-share is still max-min fair (saturation, rate order).
_REL_EPS_CHECK = 1e-9
# Local re-shares tried, each on a wider region, before re-sharing whole components.
_LOCAL_TRIES = 4

# Resolved paths kept for reuse (paths repeat: ring hops, pipeline sends).
_ROUTE_CACHE_SIZE = 65536

class TransferEvent(simpy.Event):
    """Succeeds when the last byte of a transfer arrives; `flow` is the network's handle."""

    flow: Flow | None = None


_make = object.__new__


class FlowNetwork:
    """Links with capacities (bytes/s) shared by flows under weighted max-min fairness."""

    def __init__(self, env: simpy.Environment, capacities: Mapping[LinkId, float]) -> None:
        self._env = env
        self._index: dict[LinkId, int] = {}
        self._cap: list[float] = []
        for link, cap in capacities.items():
            if not (0.0 < cap < math.inf):
                raise ValueError(f"link {link!r} needs a finite positive capacity, got {cap}")
            self._index[link] = len(self._cap)
            self._cap.append(float(cap))
        n = len(self._cap)
        self._members: list[dict[Flow, float]] = [{} for _ in range(n)]
        self._link_routes: dict[int, list[Route]] = {}  # by link index: the routes crossing it
        # Scratch per link, reused by every recomputation.
        self._filling = ProgressiveFilling(n, self._members)
        self._load = self._filling.load  # each link's re-shared load after a filling
        self._resid = [0.0] * n  # capacity left to the flows being re-shared
        self._fixed_max = [0.0] * n  # fastest flow on the link that keeps its rate
        self._new_max = [0.0] * n  # fastest re-shared flow on the link
        self._lmark = [0] * n
        self._stamp = 0
        self._comp_links: list[int] = []
        self._comp_flows: list[Flow] = []
        self._region_links: list[int] = []
        self._region_flows: list[Flow] = []
        self._comp_bounds: list[tuple[int, int]] = []
        self._routes: dict[PathUse, Route] = {}
        self._seeds: list[int] = []  # links touched since the last recomputation
        # Agenda: (flow, token) entries in buckets by due time (s), in the order posted, and a
        # heap of the due times; one SimPy wake-up for its earliest entry.
        self._times: list[float] = []
        self._due: dict[float, list[tuple[Flow, int]]] = {}
        self._current = math.inf  # the due time being applied by `_on_wake`
        self._ahead: list[float] = []  # due times posted before `_current` while applying it
        self._armed: dict[float, Flow] = {}  # pending wake-ups by due time (look-up only)
        self._apply_context = (self._due, self._bucket, self._start, self._take_off, self._seeds,
                               self._ahead)  # what `agenda_entries.apply` reads
        self._fids = itertools.count()  # the flows' ids, in order
        self._next_fid = self._fids.__next__  # a new flow's id
        self._active = 0
        self.rate_recomputations = 0
        self.flows_started = 0
        if post is not None:  # `send_message` in C: the same flow, entry and wake-up
            self.send_message = functools.partial(post, (env, Flow, self._fids, self._due,
                                                         self._bucket, self._armed, self._arm))

    @property
    def active_flows(self) -> int:
        """Flows currently moving bytes (latency paid, last byte not yet arrived)."""
        return self._active

    def capacity(self, link: LinkId) -> float:
        """Capacity of `link` in bytes/s."""
        return self._cap[self._link_index(link)]

    def current_rate(self, handle: Any) -> float:
        """Rate in bytes/s of the transfer whose event `transfer` returned; 0 if not active."""
        flow = getattr(handle, "flow", None)
        return flow.rate if flow is not None and flow.state == ACTIVE else 0.0

    def resolve(self, path: PathUse) -> Route:
        """`path` resolved once (link indices, solo rate), to pass to `transfer` many times."""
        return self._resolve(path)

    def transfer(self, path: PathUse | Route, size_bytes: float, latency_s: float = 0.0) -> simpy.Event:
        """Send `size_bytes` along `path` (or a route from `resolve`) after `latency_s` seconds.

        Returns an event that succeeds when the last byte arrives. A zero size or an empty path
        succeeds after the latency alone. Raises KeyError for a link the network does not have.
        Flows starting at the same instant join the network together.
        """
        if size_bytes < 0 or latency_s < 0:
            raise ValueError(f"size and latency must be >= 0, got {size_bytes}, {latency_s}")
        route = path if type(path) is Route else self._route(path)
        if size_bytes == 0 or not route.links:
            return self._env.timeout(latency_s)
        done = _make(TransferEvent)  # `TransferEvent(env)`, inlined
        done.env, done.callbacks = self._env, []
        done.flow = flow = _make(Flow)  # a pending flow; `Flow` lists what each field holds
        flow.fid, flow.route, flow.done, flow.state = self._next_fid(), route, done, PENDING
        flow.size = float(size_bytes)
        at = self._env._now + latency_s
        self._post(at, flow, 0)
        self._arm(at)
        return done

    def send_message(self, route: Route, size_bytes: float, latency_s: float,
                     callbacks: list, message: Any) -> Flow:
        """`transfer` of `size_bytes` > 0 over a route with links, whose event (the flow) calls
        `callbacks` (a list nobody changes, shared by many flows) and carries `message`: the
        engine's pipeline messages, with less work per flow. Returns the flow. Where
        `_agenda_entries` was built, the network's own `send_message` is its `post`, the same
        work in C."""
        flow = _make(Flow)
        flow.fid, flow.route, flow.done, flow.state = self._next_fid(), route, flow, PENDING
        flow.callbacks, flow.message, flow.size = callbacks, message, size_bytes
        at = self._env._now + latency_s
        bucket = self._due.get(at)  # `_post`, inlined
        if bucket is None:
            bucket = self._bucket(at)
        bucket.append((flow, 0))
        if at not in self._armed:
            self._arm(at)
        return flow

    # -- agenda ----------------------------------------------------------------------------

    def _link_index(self, link: LinkId) -> int:
        try:
            return self._index[link]
        except KeyError:
            raise KeyError(f"unknown link {link!r}") from None

    def _route(self, path: PathUse) -> Route:
        """Resolved `path`, cached when the path is hashable (a tuple of tuples)."""
        try:
            route = self._routes.get(path)
        except TypeError:  # a list somewhere in the path: resolve without caching
            return self._resolve(path)
        if route is None:
            route = self._resolve(path)
            if len(self._routes) >= _ROUTE_CACHE_SIZE:
                self._routes.clear()
            self._routes[path] = route
        return route

    def _resolve(self, path: PathUse) -> Route:
        """Path to (link index, weight) pairs; repeated links add their weights."""
        out: list[tuple[int, float]] = []
        at: dict[int, int] = {}  # each link's place in `out`
        for link, weight in path:
            idx = self._link_index(link)
            if not (0.0 < weight < math.inf):
                raise ValueError(f"weight on link {link!r} must be finite and > 0, got {weight}")
            k = at.get(idx)
            if k is None:
                at[idx] = len(out)
                out.append((idx, float(weight)))
            else:
                out[k] = (idx, out[k][1] + weight)
        best, bneck = math.inf, -1
        for idx, weight in out:
            rate = self._cap[idx] / weight
            if rate < best:
                best, bneck = rate, idx
        route = Route(tuple(out), (best, bneck), tuple(self._members[idx] for idx, _ in out))
        self._register(route)
        return route

    def _register(self, route: Route) -> None:
        """Add `route` to its links' routes and to the `conflicts` of the routes sharing a link
        with it (and those to its own), for the network's life."""
        known = {id(route)}
        conflicts = route.conflicts
        for idx in route.ids:
            crossing = self._link_routes.setdefault(idx, [])
            for other in crossing:
                if id(other) not in known:
                    known.add(id(other))
                    conflicts.append(other)
                    other.conflicts.append(route)
            crossing.append(route)

    def _post(self, at: float, flow: Flow, token: int) -> None:
        """Add an agenda entry due at `at` seconds."""
        bucket = self._due.get(at)
        if bucket is None:
            bucket = self._bucket(at)
        bucket.append((flow, token))

    def _bucket(self, at: float) -> list[tuple[Flow, int]]:
        """A new (empty) agenda bucket due at `at` seconds."""
        bucket = self._due[at] = []
        heapq.heappush(self._times, at)
        if at < self._current:  # before the entries being applied: `_on_wake` takes it first
            self._ahead.append(at)
        return bucket

    def _arm(self, at: float) -> None:
        """Make sure a SimPy wake-up fires at `at` seconds (one per distinct time)."""
        if at not in self._armed:
            env = self._env  # the wake-up: a succeeded event of the flows' type (`flow_records.EVENT_TYPE`)
            wake = _make(Flow)
            wake.callbacks, wake._ok, wake._value = [self._on_wake], True, at
            env.schedule(wake, NORMAL, max(at - env._now, 0.0))
            self._armed[at] = wake

    def _on_wake(self, event: simpy.Event) -> None:
        """Apply every agenda entry due by this wake-up (bucket by bucket in time order, each
        in the order posted: start a pending flow, finish an active one whose entry is live),
        recompute once, arm the next one. A stale entry (`token`) does nothing."""
        due: float = event._value  # the due time the wake-up was armed with
        del self._armed[due]
        times, ahead = self._times, self._ahead
        env, due_at, now = self._env, self._due, self._env._now
        # A completion's `env.schedule(done)`: to the bucket being processed where there is one.
        fire = env.schedule if getattr(env, "now_bucket", None) is None else env.now_bucket.append
        lone = ended = 0  # flows started alone on their links, flows ended (counted at the end)
        context = self._apply_context
        while times and times[0] <= due:
            at = self._current = times[0]
            bucket = due_at[at]
            # Entries posted meanwhile at `at` join the end (`apply` takes them too).
            i, started, finished = apply(bucket, now, fire, context)
            lone += started
            ended += finished
            if i < 0:
                heapq.heappop(times)
                del due_at[at]
            else:  # stopped for an entry due before `at`: apply it first
                del bucket[:i]
                ahead.clear()
        self._current = math.inf
        self._active += lone - ended
        self.flows_started += lone
        if self._seeds:
            self._update()
        self._arm_next()

    def _arm_next(self) -> None:
        """Arm a wake-up for the earliest live agenda entry, dropping stale ones before it."""
        times = self._times
        while times:
            at = times[0]
            bucket = self._due[at]
            for i, (flow, token) in enumerate(bucket):
                if flow.state == PENDING or (flow.state == ACTIVE and token == flow.token):
                    del bucket[:i]
                    self._arm(at)
                    return
            heapq.heappop(times)
            del self._due[at]

    def _start(self, flow: Flow, now: float) -> None:
        """Put `flow` on its links where another flow is on one of them: any flow alone on its
        links there is listed in their member maps (as at its start), then `flow`, and the
        links are re-shared. (A flow alone on all its links gets its rate at once and stays out
        of their member maps until another flow joins one of them, `Route.lone`: `_on_wake`.)"""
        flow.state, flow.since, flow.rate, flow.token, flow.bneck = ACTIVE, now, 0.0, 0, -1
        route = flow.route
        self._active += 1
        self.flows_started += 1
        for other in route.conflicts:
            lone = other.lone
            if lone is not None:  # it was alone on its links: listed as at its start
                other.lone, lone.bneck = None, other.solo_bneck
                self._list(lone)
        route.active += 1
        self._list(flow)
        self._seeds.extend(route.ids)

    def _list(self, flow: Flow) -> None:
        """Add `flow` to its links' member maps, with the fields that sharing reads (the bytes
        it had left when it started moving, as it was not re-shared before)."""
        flow.links, flow.mark, flow.new_rate, flow.remaining = flow.route.links, 0, -1.0, flow.size
        for link_members, weight in zip(flow.route.members, flow.route.weights):
            link_members[flow] = weight

    def _take_off(self, flow: Flow, seeds: list[int] | None) -> None:
        """Remove a listed `flow` from its links; add those with flows left to `seeds`."""
        flow.route.active -= 1
        for link_members, link in zip(flow.route.members, flow.route.ids):
            del link_members[flow]
            if link_members and seeds is not None:
                seeds.append(link)

    # -- sharing ---------------------------------------------------------------------------
    #
    # A recomputation first re-shares only the region R: the flows on the touched links. Flows
    # outside R keep their rates and their load is subtracted from the capacities. The result
    # is accepted if it is max-min fair as a whole, which holds iff every flow has a bottleneck
    # (a saturated link where no flow is faster; Bertsekas and Gallager, section 6.5.2): each
    # flow of R must not be slower than a kept flow on the link where it froze, and each kept
    # flow whose bottleneck lies in R's links must still find it saturated and itself fastest.
    # Otherwise R takes in the flows on the offending bottleneck links and tries again; after
    # _LOCAL_TRIES refusals the connected components around R are re-shared whole.

    def _update(self) -> None:
        """Retire finished flows around the touched links, then re-share what they affect."""
        now = self._env._now
        finished: list[Flow] = []
        seeds = self._gather(list(self._seeds), now, finished)
        self._seeds.clear()
        flows, links = self._region_flows, self._region_links
        if flows:
            self.rate_recomputations += 1
            for _ in range(_LOCAL_TRIES):
                wider = self._share_locally(flows, links)
                if not wider:
                    break
                for flow in flows:
                    flow.new_rate = -1.0  # discard the rejected result
                seeds = self._gather(seeds + wider, now, finished)
            else:
                flows = self._share_components(links)
            self._reschedule(flows, now)
        schedule = self._env.schedule
        for flow in finished:  # `done.succeed()`, inlined (a flow as event has no methods)
            done, flow.done = flow.done, None  # no flow <-> event cycle left to collect
            done._ok, done._value = True, None
            schedule(done)

    def _gather(self, seeds: list[int], now: float, finished: list[Flow]) -> list[int]:
        """Build the region of `seeds`, retiring finished flows into `finished` (widening the
        seeds to their links, whose capacity they free); return the final seeds."""
        flows, links = self._region(seeds)
        more = self._retire(flows, now)
        while more:
            finished.extend(more)
            seeds = list(links)
            flows, links = self._region(seeds)
            more = self._retire(flows, now)
        return seeds

    def _region(self, seeds: list[int]) -> tuple[list[Flow], list[int]]:
        """Active flows on the `seeds` links, and every link those flows cross (stamped)."""
        self._stamp += 1
        stamp = self._stamp
        lmark, members = self._lmark, self._members
        flows, links = self._region_flows, self._region_links
        flows.clear()
        links.clear()
        for seed in seeds:
            if lmark[seed] != stamp:
                lmark[seed] = stamp
                links.append(seed)
                for flow in members[seed]:
                    if flow.mark != stamp:
                        flow.mark = stamp
                        flows.append(flow)
        for flow in flows:
            for link, _ in flow.links:
                if lmark[link] != stamp:
                    lmark[link] = stamp
                    links.append(link)
        return flows, links

    def _share_locally(self, flows: list[Flow], links: list[int]) -> list[int]:
        """Re-share `flows` (the region, stamped) around the kept flows.

        Returns [] if the result is max-min fair, else the links whose flows must join.
        """
        stamp = self._stamp
        cap, members, resid, fixed_max = self._cap, self._members, self._resid, self._fixed_max
        crossings = 0
        for link in links:
            fixed = 0.0
            fastest = 0.0
            for other, w in members[link].items():
                if other.mark != stamp:
                    rate = other.rate
                    fixed += w * rate
                    if rate > fastest:
                        fastest = rate
            crossings += len(members[link])
            left = cap[link] - fixed
            resid[link] = left if left > 0.0 else 0.0
            fixed_max[link] = fastest
        self._filling.fill(flows, links, resid, self._stamp)
        if crossings == sum(len(flow.links) for flow in flows):
            return []  # no kept flow: the region is whole components
        return self._unfair_links(flows, links)

    def _unfair_links(self, flows: list[Flow], links: list[int]) -> list[int]:
        """Bottleneck links that break max-min fairness after a local re-share (see above)."""
        stamp = self._stamp
        cap, load, resid, members = self._cap, self._load, self._resid, self._members
        fixed_max, new_max, lmark = self._fixed_max, self._new_max, self._lmark
        slack = 1.0 + _REL_EPS_CHECK
        full = 1.0 - _REL_EPS_CHECK
        wider: list[int] = []
        for link in links:
            new_max[link] = 0.0
        for flow in flows:
            rate = flow.new_rate
            if rate <= 0.0 or rate * slack < fixed_max[flow.bneck]:
                wider.append(flow.bneck)  # a kept flow there is faster: it must yield
            for link, _ in flow.links:
                if rate > new_max[link]:
                    new_max[link] = rate
        for link in links:
            for other in members[link]:
                if other.mark == stamp:
                    continue
                b = other.bneck
                if lmark[b] != stamp:
                    continue  # its bottleneck is untouched
                used = cap[b] - resid[b] + load[b]
                if used < cap[b] * full or other.rate * slack < max(new_max[b], fixed_max[b]):
                    wider.append(b)  # the kept flow lost its bottleneck
        return wider

    def _share_components(self, seeds: list[int]) -> list[Flow]:
        """Re-share whole connected components around `seeds`; return their flows."""
        for flow in self._region_flows:
            flow.new_rate = -1.0  # discard the rejected local result
        flows, links, bounds = self._components(seeds)
        cap = self._cap
        f0 = l0 = 0
        for f1, l1 in bounds:
            self._filling.fill(flows[f0:f1], links[l0:l1], cap, self._stamp)
            f0, l0 = f1, l1
        return flows

    def _components(self, seeds: list[int]) -> tuple[list[Flow], list[int], list[tuple[int, int]]]:
        """Flows and links connected to `seeds`, grouped by connected component.

        Returns (flows, links, bounds): component k spans flows[f_{k-1}:f_k] and
        links[l_{k-1}:l_k] where bounds[k] = (f_k, l_k). Breadth-first from the seeds in order.
        """
        self._stamp += 1
        stamp = self._stamp
        lmark, members = self._lmark, self._members
        links, flows, bounds = self._comp_links, self._comp_flows, self._comp_bounds
        links.clear()
        flows.clear()
        bounds.clear()
        for seed in seeds:
            if lmark[seed] == stamp:
                continue
            lmark[seed] = stamp
            i = len(links)
            n_flows = len(flows)
            links.append(seed)
            while i < len(links):
                for flow in members[links[i]]:
                    if flow.mark != stamp:
                        flow.mark = stamp
                        flows.append(flow)
                        for link, _ in flow.links:
                            if lmark[link] != stamp:
                                lmark[link] = stamp
                                links.append(link)
                i += 1
            if len(flows) > n_flows:
                bounds.append((len(flows), len(links)))
            else:
                del links[-1]  # an empty link on its own
        return flows, links, bounds

    def _retire(self, flows: list[Flow], now: float) -> list[Flow]:
        """Remove from `flows` (in place) those within epsilon of their last byte, by id."""
        finished: list[Flow] = []
        time_eps = now * _REL_EPS_TIME
        for flow in flows:
            rate = flow.rate
            if rate > 0.0:
                left = flow.remaining - rate * (now - flow.since)
                if left <= _REL_EPS_BYTES * flow.size or left <= rate * time_eps:
                    finished.append(flow)
        if finished:
            finished.sort(key=lambda f: f.fid)
            for flow in finished:
                self._take_off(flow, None)
                flow.state, flow.remaining, flow.rate = DONE, 0.0, 0.0
                self._active -= 1
            flows[:] = [f for f in flows if f.state == ACTIVE]
        return finished

    def _reschedule(self, flows: list[Flow], now: float) -> None:
        """Adopt each flow's `new_rate`; post a completion only where the rate changed."""
        post = self._post
        for flow in flows:
            new = flow.new_rate
            flow.new_rate = -1.0
            old = flow.rate
            if old > 0.0:
                if abs(new - old) <= _REL_EPS_RATE * old:
                    continue
                flow.remaining -= old * (now - flow.since)
            flow.since = now
            flow.rate = new
            flow.token += 1
            post(now + flow.remaining / new, flow, flow.token)
