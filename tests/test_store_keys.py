"""The node store's slot keys remembered per namespace (`SlotKeyMemo`, issue #51): always the
bytes `slot_keys` gives - per namespace, across its limit, for new and known keys alike - each
key hashed once while it is remembered, and never more keys held than the limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_support import sglang  # noqa: F401 - a fixture

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
    would not even hash - so each is refused when made, naming the field and the value."""
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


def _grid():
    """Every rank layout SGLang 0.5.23's storage config admits at TP <= 4, PP and CP <= 2, DCP
    (MLA only, contiguous groups within TP) <= 2: (is_mla, tp, pp, cp, dcp) as (rank, size) pairs."""
    for is_mla in (True, False):
        for tp_size in (1, 2, 4):
            for tp_rank in range(tp_size):
                for pp in ((0, 1), (0, 2), (1, 2)):
                    for cp in ((0, 1), (0, 2), (1, 2)):
                        for dcp_size in (1, 2) if is_mla else (1,):
                            if tp_size % dcp_size == 0:
                                yield is_mla, (tp_rank, tp_size), pp, cp, (tp_rank % dcp_size, dcp_size)


@pytest.mark.parametrize("pool", ["kv", "mamba"])
def test_ranks_share_a_namespace_exactly_where_sglangs_hicache_file_shares_a_file(sglang, tmp_path, pool):
    """The shard in a namespace (`shard_of`) against SGLang 0.5.23's own HiCacheFile, which keys a
    page's file by a suffix of its rank layout: over every layout of the grid, two engines' pages
    share a namespace exactly when HiCacheFile gives them one file - never pages another rank's
    bytes could answer (a shared namespace where SGLang keeps two files), never a miss SGLang would hit."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    by_suffix: dict[str, set] = {}
    by_shard: dict[tuple, set] = {}
    for is_mla, (tp_rank, tp_size), (pp_rank, pp_size), (cp_rank, cp_size), (dcp_rank, dcp_size) in _grid():
        config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=cp_rank,
            attn_cp_size=cp_size, is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="org/model", dcp_size=dcp_size, dcp_rank=dcp_rank,
            logical_page_size=64 if dcp_size > 1 else None)
        key = "page-hash" + (".mamba" if pool == "mamba" else "")
        suffix = HiCacheFile(config, file_path=str(tmp_path))._get_suffixed_key(key)
        shard = _keys.shard_of(is_mla=is_mla, pool=pool, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                               pp_size=pp_size, cp_rank=cp_rank, cp_size=cp_size, dcp_rank=dcp_rank, dcp_size=dcp_size)
        by_suffix.setdefault(suffix, set()).add(shard)
        by_shard.setdefault(shard, set()).add(suffix)
    assert len(by_suffix) > 20
    assert {s: shards for s, shards in by_suffix.items() if len(shards) > 1} == {}  # one file, two namespaces
    assert {s: suffixes for s, suffixes in by_shard.items() if len(suffixes) > 1} == {}  # one namespace, two files
