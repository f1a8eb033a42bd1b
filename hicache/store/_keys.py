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

DIGEST_BYTES = 16


@attrs.frozen
class Namespace:
    """One kind of stored object. ``shard``: the (rank, size) pairs that split a page's bytes
    (``tp`` for MHA and Mamba state, ``pp``, ``cp``, ``dcp``); absent where ranks share bytes."""

    model: str
    dtype: str
    page_tokens: int
    layout: str
    pool: str
    page_bytes: int
    shard: tuple[tuple[str, int, int], ...] = ()

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
    """The 16-byte slot key of each of SGLang's ``keys`` in a namespace, concatenated."""
    return b"".join([hashlib.blake2b(namespace_digest + key.encode(), digest_size=DIGEST_BYTES).digest()
                     for key in keys])


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
    DCP shards MLA."""
    shard = []
    if not is_mla or pool == "mamba":
        shard.append(("tp", tp_rank, tp_size))
    if pp_size > 1:
        shard.append(("pp", pp_rank, pp_size))
    if cp_size > 1:
        shard.append(("cp", cp_rank, cp_size))
    if dcp_size > 1:
        shard.append(("dcp", dcp_rank, dcp_size))
    return tuple(shard)
