"""Progressive filling (Bertsekas and Gallager, "Data Networks", 2nd ed., section 6.5.2): the
weighted max-min fair rates of a set of flows over links with given capacities, as the flow
network (`sim.network`) re-shares them. All unfrozen flows rise at one rate (the level); when a
link saturates, the flows crossing it freeze at the level.

Flows are the network's: `links` ((link index, weight) pairs), `mark` (the stamp of the set
being re-shared), and the results `new_rate` (bytes/s) and `bneck` (the link it froze on).
"""

from __future__ import annotations

import heapq
import math


class ProgressiveFilling:
    """Scratch per link (load, summed weight, unfrozen flows), reused by every filling."""

    def __init__(self, n: int, members: list[dict]) -> None:
        self.load = [0.0] * n  # bytes/s of the re-shared flows on each link
        self._wsum = [0.0] * n
        self._nfree = [0] * n
        self._members = members  # the network's flows per link

    def fill(self, alive: list, links: list[int], caps: list[float], stamp: int) -> None:
        """Progressive filling of `alive` over `links` with capacities `caps` (bytes/s).

        Sets each flow's `new_rate` and `bneck`; leaves each link's re-shared load in `load`.
        The flows being re-shared carry `mark == stamp`.
        """
        if len(alive) == 1:
            self._fill_one(alive[0], caps)
            return
        self._count_crossings(alive, links)
        unfrozen = self._freeze_lone_flows(alive, caps)
        if unfrozen:
            self._raise_level(links, caps, unfrozen, stamp)

    def _fill_one(self, flow: object, caps: list[float]) -> None:
        """A single flow takes its narrowest link's capacity / weight."""
        best, bneck = math.inf, -1
        for link, w in flow.links:
            rate = caps[link] / w
            if rate < best:
                best, bneck = rate, link
        flow.new_rate, flow.bneck = best, bneck
        load = self.load
        for link, w in flow.links:
            load[link] = w * best

    def _count_crossings(self, alive: list[object], links: list[int]) -> None:
        """Zero each link's load; set its summed weight and count of unfrozen flows."""
        load, wsum, nfree = self.load, self._wsum, self._nfree
        for link in links:
            load[link] = 0.0
            wsum[link] = 0.0
            nfree[link] = 0
        for flow in alive:
            for link, w in flow.links:
                wsum[link] += w
                nfree[link] += 1

    def _freeze_lone_flows(self, alive: list[object], caps: list[float]) -> int:
        """Freeze each flow alone on all its links at its narrowest one (taking those links
        out of the filling); return how many flows remain unfrozen."""
        load, nfree = self.load, self._nfree
        unfrozen = len(alive)
        for flow in alive:
            best, bneck = math.inf, -1
            for link, w in flow.links:
                if nfree[link] != 1:
                    break
                rate = caps[link] / w
                if rate < best:
                    best, bneck = rate, link
            else:
                flow.new_rate, flow.bneck = best, bneck
                unfrozen -= 1
                for link, w in flow.links:
                    load[link] = w * best
                    nfree[link] = 0
        return unfrozen

    def _raise_level(self, links: list[int], caps: list[float], unfrozen: int, stamp: int) -> None:
        """Raise the `unfrozen` flows' common rate (the level) link by link: the next link to
        saturate is the one with the lowest (capacity - load) / unfrozen weight (a heap); the
        re-shared flows on it not yet frozen freeze at the level, loading their other links."""
        load, wsum, nfree, members = self.load, self._wsum, self._nfree, self._members
        heap = [(caps[link] / wsum[link], link) for link in links if nfree[link]]
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        level = 0.0
        while unfrozen:
            key, link = pop(heap)
            if not nfree[link]:
                continue
            sat = (caps[link] - load[link]) / wsum[link]
            if sat > key:  # the link gained headroom since it was pushed
                push(heap, (sat, link))
                continue
            if sat > level:
                level = sat
            for flow in members[link]:
                if flow.new_rate < 0.0 and flow.mark == stamp:
                    flow.new_rate = level
                    flow.bneck = link
                    unfrozen -= 1
                    for other, w in flow.links:
                        load[other] += w * level
                        wsum[other] -= w
                        nfree[other] -= 1
