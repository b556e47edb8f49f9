"""Closed forms of a stage's data-parallel buckets ((time s, ready point 0..1 of the backward)
each) run one after another on streams: their total on one stream (`total_s`), the first
forward's wait for parameter all-gathers (`gather_delay_s`; of each chunk's first forward,
`gather_floors`), the gradient reductions' end after the backward that releases them
(`released_reduction_tail_s`; released at given times, `reduction_tail_s`), and the dense and the
routed experts' buckets on two streams that share one link (`merged_delay_s`,
`merged_gather_floors`, `shared_link_ends`: processor sharing).
"""

from __future__ import annotations

import math


def total_s(buckets: tuple[tuple[float, float], ...]) -> float:
    """Seconds of (time s, ready point) buckets back to back on one stream."""
    return sum(r for r, _ in buckets)


def gather_delay_s(buckets: tuple[tuple[float, float], ...], forward_s: float) -> float:
    """How long the first forward (`forward_s` s) must wait to consume the buckets ((time s,
    ready point p of the backward) in release order) in forward order, the reverse, as their
    all-gathers complete back to back in that order (Megatron-Core's
    `next_param_gather_bucket_group`): bucket i's share of the forward starts at 1 - p_i (the
    last released at 0), so the delay is max(0, max over i of (end of gather i) - forward_s
    (1 - p_i))."""
    best, done, last = 0.0, 0.0, len(buckets) - 1
    for i in range(last, -1, -1):
        r, point = buckets[i]
        done += r
        wait = done - forward_s * (0.0 if i == last else 1.0 - point)
        if wait > best:  # `max(best, wait)`
            best = wait
    return best


def gather_floors(chunks: list[tuple[tuple[float, float], ...]], forwards: list[float]
                  ) -> list[float]:
    """When (s) each chunk's first forward (`forwards[c]` s) may start, its buckets ((time s,
    ready point within the chunk's backward) in release order) consumed in forward order as
    their all-gathers complete: the engine gathers every chunk's buckets on one stream at once,
    chunk 0's first (`sim.engine`'s `_submit_gathers`), so chunk c's wait (`gather_delay_s`)
    counts from the end of the gathers of the chunks before it."""
    out, before = [], 0.0
    for buckets, forward in zip(chunks, forwards, strict=True):
        out.append(before + gather_delay_s(buckets, forward))
        before += total_s(buckets)
    return out


def reduction_tail_s(dense: list[tuple[float, float]], expert: list[tuple[float, float]]) -> float:
    """Gradient reductions ((release s, time s) each, in release order; release relative to
    the stage's last op's end, so at most 0) of the dense buffer on one stream and of the
    routed experts' on another, the two sharing one link (`shared_link_ends`): seconds the
    last ends after the stage's last op."""
    if not expert:
        t = -math.inf
        for release, r in dense:
            t = (release if release > t else t) + r  # `max(t, release) + r`
        return max(0.0, t)
    origin = min(release for release, _ in dense + expert)
    ends = shared_link_ends(tuple([(release - origin, r) for release, r in jobs]
                                  for jobs in (dense, expert)))
    return max(0.0, max(e[-1] for e in ends if e) + origin)


def released_reduction_tail_s(buckets: tuple[tuple[float, float], ...], window_s: float) -> float:
    """Gradient buckets ((reduction time s, ready point p) in release order) released during
    the last backward (bucket i at window_s p_i) and reduced one after another on one stream:
    seconds the last reduction ends after the backward does."""
    t = 0.0
    for r, point in buckets:
        release = window_s * point
        t = (release if release > t else t) + r  # `max(t, release) + r`
    return max(0.0, t - window_s)


def _marks(dense: tuple[tuple[float, float], ...], expert: tuple[tuple[float, float], ...]
           ) -> list[tuple[float, bool, float]]:
    """Dense and expert buckets as (ready point, expert, time s) in the engine's order
    (`sim.gradient_buckets`: both buffers' buckets by ready point, the last ending the pass)."""
    return sorted([(point, False, r) for r, point in dense] +
                  [(point, True, r) for r, point in expert], key=lambda m: (m[0], m[1]))


def merged_delay_s(dense: tuple[tuple[float, float], ...], expert: tuple[tuple[float, float], ...],
                   window_s: float) -> float:
    """Dense and expert buckets ((time s, ready point) each) in the engine's order (`_marks`),
    each buffer's on its own stream, the two sharing the link that both rings leave every
    member by (`shared_link_ends`): reductions released at their points of a `window_s`
    backward; seconds the last ends after it (`released_reduction_tail_s`)."""
    jobs: tuple[list, list] = ([], [])
    for point, is_expert, r in _marks(dense, expert):
        jobs[is_expert].append((window_s * point, r))
    ends = shared_link_ends(jobs)
    return max(0.0, max(e[-1] for e in ends if e) - window_s)


def merged_gather_floors(dense: list[tuple[tuple[float, float], ...]],
                         expert: list[tuple[tuple[float, float], ...]], forwards: list[float]
                         ) -> list[float]:
    """`gather_floors` with each chunk's dense and expert buckets ((time s, ready point) each):
    all-gathers from the start, each buffer's on its own stream (chunk 0's first, each chunk's
    in forward order, the reverse of `_marks`), the two sharing one link (`shared_link_ends`);
    each bucket's share of its chunk's first forward, from 1 - its point, waits for its own."""
    jobs: tuple[list, list] = ([], [])
    order = []
    for c, pair in enumerate(zip(dense, expert, strict=True)):
        marks = _marks(*pair)
        marks = [(1.0 if k == len(marks) - 1 else m[0], m[1], m[2]) for k, m in enumerate(marks)]
        for point, is_expert, r in reversed(marks):
            jobs[is_expert].append((0.0, r))
            order.append((c, is_expert, len(jobs[is_expert]) - 1, 1.0 - point))
    ends = shared_link_ends(jobs)
    floors = [0.0] * len(forwards)
    for c, e, k, start in order:
        floors[c] = max(floors[c], ends[e][k] - forwards[c] * start)
    return floors


def shared_link_ends(jobs: tuple[list[tuple[float, float]], ...]) -> list[list[float]]:
    """End times (s) of each stream's jobs ((release s, seconds alone) in stream order): a
    stream runs its jobs one after another, each from its release or its predecessor's end,
    and the streams running at a moment share their common bottleneck link equally (the flow
    network's max-min share of one link: processor sharing)."""
    ends: list[list[float]] = [[] for _ in jobs]
    left: list[float | None] = [None] * len(jobs)
    now = 0.0
    while any(len(e) < len(j) for e, j in zip(ends, jobs)):
        pending = [i for i, j in enumerate(jobs) if len(ends[i]) < len(j)]
        active = [i for i in pending if jobs[i][len(ends[i])][0] <= now]
        if not active:
            now = min(jobs[i][len(ends[i])][0] for i in pending)
            continue
        for i in active:
            if left[i] is None:
                left[i] = jobs[i][len(ends[i])][1]
        share = len(active)
        finish = min(left[i] * share for i in active)
        releases = [jobs[i][len(ends[i])][0] - now for i in pending if i not in active]
        step = min([finish] + releases)
        for i in active:
            if step == finish and left[i] * share == finish:
                ends[i].append(now + step)
                left[i] = None
            else:
                left[i] -= step / share
        now += step
    return ends
