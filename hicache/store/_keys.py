"""What a stored page is keyed by: SGLang's page hash inside a namespace.

SGLang's page key is a SHA-256 chain over token ids with no model, dtype, layout or rank in it
(`mem_cache/utils.py`); back ends add those. A `Namespace` holds everything that changes a
page's bytes - model (SGLang's `storage_model_name`, the pool format tag included), dtype, page
tokens, object layout and page bytes, the pool's name, the TP rank/size for MHA (none for MLA,
whose ranks hold the same bytes; always for Mamba state), PP and CP shards - and its digest
seeds every slot key, so another model's or rank's page is a miss, never its bytes. Pure.
"""

from __future__ import annotations

import hashlib
import json

import attrs

from hicache.errors import PlanError, TransferError
from hicache.plan.checks import as_int, check_int

DIGEST_BYTES = 16


def _text(allow_empty: bool):
    """attrs validator: a string (non-empty unless ``allow_empty``), else a `PlanError` naming it."""
    def check(namespace, attribute, value) -> None:
        if not isinstance(value, str) or not (value or allow_empty):
            what = "a string" if allow_empty else "a non-empty string"
            raise PlanError(f"Namespace.{attribute.name} must be {what}, got {value!r}")
    return check


def _count(namespace, attribute, value) -> None:
    check_int(PlanError, "Namespace", attribute.name, value)


def _page_bytes(namespace, attribute, value) -> None:
    """A page the store can hold: whole 8-byte words (its checksum's word), else no put could succeed."""
    if check_int(PlanError, "Namespace", attribute.name, value) % 8:
        raise PlanError(f"Namespace.page_bytes must be a multiple of 8 (the store's checksum word), got {value}")


def _shard(pairs) -> tuple:
    """The (name, rank, size) triples as a tuple of plain ints, each rank below its size."""
    triples = []
    for index, triple in enumerate(pairs):
        if not isinstance(triple, (tuple, list)) or len(triple) != 3 or not isinstance(triple[0], str):
            raise PlanError(f"Namespace.shard must hold (name, rank, size) triples, got {triple!r}")
        name = triple[0]
        rank = check_int(PlanError, "Namespace", f"shard[{index}] rank", as_int(triple[1]), minimum=0)
        size = check_int(PlanError, "Namespace", f"shard[{index}] size", as_int(triple[2]))
        if rank >= size:
            raise PlanError(f"Namespace.shard: {name} rank {rank} is not below its size {size}")
        triples.append((name, rank, size))
    return tuple(triples)


@attrs.frozen
class Namespace:
    """One kind of stored object. ``shard``: the (rank, size) pairs that split a page's bytes
    (``tp`` for MHA and Mamba state, ``pp``, ``cp``, ``dcp-in-tp<size>``); absent where ranks share bytes.
    Checked when made (each field seeds every slot key: a bad one is a namespace nobody asks
    for, every page a miss), numpy integers taken as plain ints."""

    model: str = attrs.field(validator=_text(allow_empty=True))
    dtype: str = attrs.field(validator=_text(allow_empty=False))
    page_tokens: int = attrs.field(converter=as_int, validator=_count)
    layout: str = attrs.field(validator=_text(allow_empty=False))
    pool: str = attrs.field(validator=_text(allow_empty=False))
    page_bytes: int = attrs.field(converter=as_int, validator=_page_bytes)
    shard: tuple[tuple[str, int, int], ...] = attrs.field(default=(), converter=_shard)

    @property
    def description(self) -> str:
        """A one-line description for `hicache store status` (stored in the arena's table)."""
        parts = [self.model or "-", self.pool, self.dtype, f"page {self.page_tokens}", self.layout,
                 f"{self.page_bytes} B"]
        parts += [f"{name} {rank}/{size}" for name, rank, size in self.shard]
        return " ".join(parts)

    @property
    def digest(self) -> bytes:
        canonical = json.dumps(attrs.asdict(self), sort_keys=True)
        return hashlib.blake2b(canonical.encode(), digest_size=DIGEST_BYTES, person=b"hicache-ns").digest()


def slot_keys(namespace_digest: bytes, keys) -> bytes:
    """The 16-byte slot key of each of SGLang's ``keys`` in a namespace, concatenated (a key that
    is no string: a `TransferError` naming it - checked only when one fails, off the hot path)."""
    try:
        return b"".join([hashlib.blake2b(namespace_digest + key.encode(), digest_size=DIGEST_BYTES).digest()
                         for key in keys])
    except AttributeError:
        index, key = next((i, k) for i, k in enumerate(keys) if not isinstance(k, str))
        raise TransferError(f"keys must be strings: key {index} is {key!r} ({type(key).__name__})") from None


class SlotKeyMemo:
    """`slot_keys`, each key hashed once per namespace while it is remembered: SGLang asks
    `batch_exists` for a prefix and then reads (or writes) the same keys, and a hot prefix is read
    again and again (hashing a 128-key batch was a twentieth of a 64 KiB-page read: issue #51).
    At most ``limit`` keys are remembered (then it starts afresh); dict reads and writes only, so
    SGLang's threads may share it."""

    def __init__(self, limit: int = 1 << 15) -> None:
        self.limit = limit
        self._known: dict[bytes, dict[str, bytes]] = {}

    def forget(self) -> None:
        """Remember nothing (the next batch of every namespace is hashed afresh)."""
        self._known = {}

    def __call__(self, namespace_digest: bytes, keys) -> bytes:
        known = self._known.get(namespace_digest)
        if known is not None:
            try:
                return b"".join([known[key] for key in keys])
            except (KeyError, TypeError):  # a new key (or one slot_keys refuses below)
                pass
        fresh = slot_keys(namespace_digest, keys)
        if known is None or len(known) + len(keys) > self.limit:
            known = self._known[namespace_digest] = {}
        if len(keys) <= self.limit:
            known.update(zip(keys, (fresh[i:i + DIGEST_BYTES] for i in range(0, len(fresh), DIGEST_BYTES))))
        return fresh


def shard_of(*, is_mla: bool, pool: str, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1,
             cp_rank: int = 0, cp_size: int = 1, dcp_rank: int = 0, dcp_size: int = 1) -> tuple:
    """The shard a rank's pages of ``pool`` belong to, by SGLang 0.5.23's rules (HiCacheFile's
    key suffix, `hicache_storage.py:738-771`): MLA KV is replicated across TP ranks (no TP in it),
    Mamba state is always TP-sharded, PP and attention CP split every page when larger than 1;
    DCP shards MLA, one shard per DCP rank within a TP of one size (``dcp-in-tp<size>``: SGLang
    keys the TP size in, so engines of two TP sizes share no DCP page - a test holds the two
    rules equal over every layout)."""
    shard = []
    if not is_mla or pool == "mamba":
        shard.append(("tp", tp_rank, tp_size))
    if pp_size > 1:
        shard.append(("pp", pp_rank, pp_size))
    if cp_size > 1:
        shard.append(("cp", cp_rank, cp_size))
    if dcp_size > 1:
        shard.append((f"dcp-in-tp{tp_size}", dcp_rank, dcp_size))
    return tuple(shard)
