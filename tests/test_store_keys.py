"""The node store's slot keys remembered per namespace (`SlotKeyMemo`, issue #51): always the
bytes `slot_keys` gives - per namespace, across its limit, for new and known keys alike - each
key hashed once while it is remembered, and never more keys held than the limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.store import _keys
from hicache.store._keys import SlotKeyMemo, slot_keys

DIGESTS = [bytes([n]) * 16 for n in range(3)]


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(DIGESTS), st.lists(st.text(max_size=6), max_size=12)), max_size=30),
       limit=st.integers(1, 16))
def test_the_memo_gives_what_slot_keys_gives_in_every_namespace(calls, limit):
    """Any sequence of batches over three namespaces sharing key names, any limit (resets
    included): each answer is the oracle's `slot_keys` of that namespace's digest."""
    memo = SlotKeyMemo(limit=limit)
    for digest, keys in calls:
        assert memo(digest, keys) == slot_keys(digest, keys)
        assert all(len(known) <= limit for known in memo._known.values())


def test_a_known_batch_is_not_hashed_again(monkeypatch):
    """SGLang's exists-then-read of one batch hashes its keys once; a batch with one new key
    hashes again (and is right)."""
    hashed = []

    def counting(digest, keys):
        hashed.append(list(keys))
        return slot_keys(digest, keys)

    monkeypatch.setattr(_keys, "slot_keys", counting)
    memo, keys = SlotKeyMemo(), [f"k{i}" for i in range(128)]
    assert memo(DIGESTS[0], keys) == memo(DIGESTS[0], keys) == slot_keys(DIGESTS[0], keys)
    assert len(hashed) == 1
    assert memo(DIGESTS[0], keys + ["new"]) == slot_keys(DIGESTS[0], keys + ["new"]) and len(hashed) == 2
    assert memo(DIGESTS[1], keys) == slot_keys(DIGESTS[1], keys) and len(hashed) == 3  # another namespace
    memo.forget()
    assert memo(DIGESTS[0], keys) == slot_keys(DIGESTS[0], keys) and len(hashed) == 4  # forgotten: hashed again


def test_a_key_slot_keys_refuses_is_refused_alike():
    """A key that is not a string fails as `slot_keys` fails, known batch or not."""
    memo = SlotKeyMemo()
    memo(DIGESTS[0], ["a"])
    for keys in ([7], ["a", 7]):
        with pytest.raises(AttributeError):
            slot_keys(DIGESTS[0], keys)
        with pytest.raises(AttributeError):
            memo(DIGESTS[0], keys)
