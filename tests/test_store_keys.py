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
    """A key that is not a string fails as `slot_keys` fails, known batch or not: a
    TransferError naming the key and its place."""
    from hicache.errors import TransferError

    memo = SlotKeyMemo()
    memo(DIGESTS[0], ["a"])
    for keys, index in (([7], 0), (["a", 7], 1)):
        with pytest.raises(TransferError, match=f"key {index} is 7 \\(int\\)"):
            slot_keys(DIGESTS[0], keys)
        with pytest.raises(TransferError, match=f"key {index} is 7 \\(int\\)"):
            memo(DIGESTS[0], keys)


@pytest.mark.parametrize("field, value, message", [
    ("page_bytes", 0, "Namespace.page_bytes must be positive, got 0"),
    ("page_bytes", 4095, "Namespace.page_bytes must be a multiple of 8 (the store's checksum word), got 4095"),
    ("page_tokens", 1.5, "Namespace.page_tokens must be an integer, got 1.5 (float)"),
    ("dtype", "", "Namespace.dtype must be a non-empty string, got ''"),
    ("pool", None, "Namespace.pool must be a non-empty string, got None"),
    ("model", 7, "Namespace.model must be a string, got 7"),
    ("shard", (("tp", 2, 2),), "Namespace.shard: tp rank 2 is not below its size 2"),
    ("shard", (("tp", 0),), "Namespace.shard must hold (name, rank, size) triples, got ('tp', 0)"),
    ("shard", (("tp", -1, 2),), "Namespace.shard[0] rank must be >= 0, got -1"),
])
def test_a_namespace_is_checked_when_made(field, value, message):
    """A namespace's fields seed every slot key: a float page size or a rank past its size would
    make a namespace no engine ever asks for (every page a miss, silently), and a numpy integer
    would not even hash - so each is refused when made, naming the field and the value. So is a
    page the store cannot hold (not whole 8-byte words: every put of it would fail)."""
    from hicache.errors import PlanError

    fields = dict(model="m", dtype="torch.bfloat16", page_tokens=16, layout="page_first/flat", pool="kv",
                  page_bytes=65536, shard=(("tp", 0, 2),))
    with pytest.raises(PlanError) as raised:
        _keys.Namespace(**{**fields, field: value})
    assert str(raised.value) == message


def test_numpy_integers_make_the_same_namespace_as_plain_ones():
    """SGLang's sizes may arrive as numpy integers: the namespace holds plain ints and digests
    exactly as the one made of plain ints (it raised in json.dumps before)."""
    import numpy

    plain = _keys.Namespace(model="m", dtype="torch.bfloat16", page_tokens=16, layout="l", pool="kv",
                            page_bytes=65536, shard=[("tp", 1, 2)])
    made = _keys.Namespace(model="m", dtype="torch.bfloat16", page_tokens=numpy.int64(16), layout="l", pool="kv",
                           page_bytes=numpy.int32(65536), shard=[["tp", numpy.int64(1), numpy.int64(2)]])
    assert made == plain and made.digest == plain.digest and made.shard == (("tp", 1, 2),)

