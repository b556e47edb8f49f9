"""A checker for Chrome Trace Event documents, written from the format's specification
(https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), restricted to
the phases holmes-sim writes: X (complete), M (metadata), s/f (flow start/finish).

`problems(doc)` returns every violation as a line; an empty list means the document passes."""

from __future__ import annotations

from collections import defaultdict

METADATA_NAMES = {"process_name": ("name", str), "thread_name": ("name", str),
                  "process_sort_index": ("sort_index", int), "thread_sort_index": ("sort_index", int)}
REQUIRED = {  # keys every event of a phase must carry, with their JSON types
    "X": {"name": str, "cat": str, "ts": int, "dur": int, "pid": int, "tid": int},
    "M": {"name": str, "pid": int, "args": dict},
    "s": {"name": str, "cat": str, "id": int, "ts": int, "pid": int, "tid": int},
    "f": {"name": str, "cat": str, "id": int, "ts": int, "pid": int, "tid": int},
}


def problems(doc: object) -> list[str]:
    """Every way `doc` breaks the format (or holmes-sim's stricter rules: integer times, no
    overlapping slices on a track, every flow bound to a slice at both ends)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["top level must be an object with a traceEvents array"]
    out = []
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        out.append("displayTimeUnit must be 'ms' or 'ns'")
    if not isinstance(doc.get("otherData", {}), dict):
        out.append("otherData must be an object")
    events = doc["traceEvents"]
    for k, e in enumerate(events):
        out += [f"event {k}: {p}" for p in _event_problems(e)]
    if out:
        return out
    return _overlaps(events) + _flows(events)


def _event_problems(e: object) -> list[str]:
    if not isinstance(e, dict) or e.get("ph") not in REQUIRED:
        return [f"unknown or missing phase in {e!r:.80}"]
    out = []
    for key, tp in REQUIRED[e["ph"]].items():
        value = e.get(key)
        if not isinstance(value, tp) or isinstance(value, bool):
            out.append(f"ph {e['ph']}: '{key}' must be {tp.__name__}, got {value!r:.40}")
    for key in ("ts", "dur"):
        if isinstance(e.get(key), int) and e[key] < 0:
            out.append(f"'{key}' is negative ({e[key]})")
    if e["ph"] == "M" and not out:
        arg, tp = METADATA_NAMES.get(e["name"], (None, None))
        if arg is None or not isinstance(e["args"].get(arg), tp):
            out.append(f"metadata {e['name']} needs args.{arg} of type {tp}")
    if e["ph"] == "X" and "args" in e:
        if not isinstance(e["args"], dict):
            out.append("args must be an object")
        elif not isinstance(e["args"].get("bytes", 0), int):
            out.append(f"args.bytes must be an integer, got {e['args']['bytes']!r}")
    if e["ph"] == "f" and e.get("bp", "e") != "e":
        out.append("bp must be 'e' when given")
    return out


def _tracks(events: list[dict]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    tracks: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        spans.sort()
    return tracks


def _overlaps(events: list[dict]) -> list[str]:
    out = []
    for track, spans in _tracks(events).items():
        for (s0, e0), (s1, e1) in zip(spans, spans[1:], strict=False):
            if s1 < e0:
                out.append(f"track {track}: slice [{s1}, {e1}) overlaps [{s0}, {e0})")
    return out


def _flows(events: list[dict]) -> list[str]:
    tracks = _tracks(events)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = defaultdict(list)
    for e in events:
        if e["ph"] == "f":
            ends[e["id"]].append(e)
    out = []
    if len(starts) != sum(1 for e in events if e["ph"] == "s"):
        out.append("flow ids of 's' events are not unique")
    for fid in set(starts) | set(ends):
        s, fs = starts.get(fid), ends.get(fid, [])
        if s is None or len(fs) != 1:
            out.append(f"flow {fid}: needs exactly one 's' and one 'f'")
            continue
        f = fs[0]
        if (s["cat"], s["name"]) != (f["cat"], f["name"]) or f["ts"] < s["ts"]:
            out.append(f"flow {fid}: 's' and 'f' differ in cat/name or 'f' is earlier")
        for end in (s, f):
            if not any(a <= end["ts"] <= b for a, b in tracks[(end["pid"], end["tid"])]):
                out.append(f"flow {fid}: '{end['ph']}' at {end['ts']} is in no slice of its track")
    return out
