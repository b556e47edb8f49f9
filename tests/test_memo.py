"""`memo.IdentityMemo`: results by the identity of the objects held with them."""

from __future__ import annotations

from holmes_sim.memo import IdentityMemo


def test_identity_memo_keeps_results_by_identity_count_and_key():
    memo: IdentityMemo[object] = IdentityMemo(size=8)
    a, b = [1], [1]  # equal, not the same
    made = []

    def make(tag):
        return lambda: made.append(tag) or tag

    assert memo.get((a,), ("k",), make("a")) == "a"
    assert memo.get((a,), ("k",), make("again")) == "a"  # kept
    assert memo.get((b,), ("k",), make("b")) == "b"  # an equal object is another entry
    assert memo.get((a,), ("other",), make("a2")) == "a2"  # another key
    assert memo.get((a, b), ("k",), make("ab")) == "ab"  # another count of objects
    assert memo.get((b, a), ("k",), make("ba")) == "ba"  # another order
    assert made == ["a", "b", "a2", "ab", "ba"]


def test_identity_memo_holds_its_objects_and_empties_when_full():
    memo: IdentityMemo[int] = IdentityMemo(size=3)
    for n in range(3):
        memo.get((object(),), (), lambda n=n: n)  # held: no later object takes their ids
    kept = object()
    assert memo.get((kept,), (), lambda: 10) == 10  # full: emptied, then kept
    assert memo.get((kept,), (), lambda: 11) == 10
    for n in range(50):  # fresh objects never find another's entry
        assert memo.get((object(),), (), lambda n=n: 100 + n) == 100 + n
