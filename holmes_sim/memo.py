"""Small caches for the planner's hot paths: results kept by the identity of the objects they
were computed from (clusters, rank orders, group tuples: large, immutable, and shared by the
candidates of a search) plus plain hashable values.

The objects are held with the result, so their ids cannot be reused while an entry lives; a full
cache is emptied (a search moves on to other layouts, and the entries are cheap to rebuild).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
_MEMOS: weakref.WeakSet = weakref.WeakSet()


class IdentityMemo(Generic[T]):
    """`get(objects, key, make)`: `make()`'s result for these very objects and this key."""

    def __init__(self, size: int = 256):
        self.size = size
        self._entries: dict[tuple, tuple[tuple, T]] = {}
        _MEMOS.add(self)

    def get(self, objects: tuple, key: tuple, make: Callable[[], T]) -> T:
        # One object (most callers): the same key without unpacking a map.
        k = (id(objects[0]), key) if len(objects) == 1 else (*map(id, objects), key)
        got = self._entries.get(k)
        # The entry holds its objects, so no other object has their ids while it lives: equal
        # ids (and count: `k`'s length) are these very objects.
        if got is not None:
            return got[1]
        value = make()
        if len(self._entries) >= self.size:
            self._entries.clear()
        self._entries[k] = (objects, value)
        return value

    def clear(self) -> None:
        self._entries.clear()


def clear_identity_memos() -> None:
    """Empty every `IdentityMemo`, for work that shares no object with what came before (a
    sweep's next point, prepared anew): their entries hold whole clusters and plans alive, and
    would only be dropped once each memo fills."""
    for memo in list(_MEMOS):
        memo.clear()
