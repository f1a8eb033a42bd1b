"""SGLang's record of what is registered in each host buffer, kept for a pool: the attribute
``_sglang_cuda_host_registered_ranges`` = ``[(ptr, size), ...]`` on each tensor (SGLang's own
unregister reads it; without it, it would treat a buffer as one range). A progressive pool's
chunks register before its tensors are known and after: `RangeRecords` takes both. The caller
holds the pool's lock around every call. Imports nothing of hicache.
"""

from __future__ import annotations

#: SGLang's record of registered ranges on a host tensor (pool_host/common.py)
RANGES_ATTR = "_sglang_cuda_host_registered_ranges"


class RangeRecords:
    """One pool's records: `note` a registered chunk (by offset until `attach` puts the records
    on the tensors, on them after), `attach` them, `clear` them when the memory goes."""

    def __init__(self) -> None:
        self._early: list | None = None  # (buffer, offset, size) noted before the tensors exist
        self._records: list | None = None  # (tensor, its record) per buffer, once attached

    def expect_chunks(self) -> None:
        """Chunks will be noted as they register (a progressive pool): `attach` records those,
        not the handle's registrations."""
        self._early = []

    def note(self, buffer: int, offset: int, size: int) -> None:
        """A chunk of ``size`` bytes at ``offset`` in ``buffer`` is registered."""
        if self._records is None:
            self._early.append((buffer, offset, size))
        elif self._records:  # cleared: the memory is gone, nothing to record
            tensor, record = self._records[buffer]
            record.append((tensor.data_ptr() + offset, size))

    def attach(self, tensors, held) -> None:
        """Put each tensor's record on it: the chunks noted so far where they are expected,
        else the ranges in ``held()`` (the handle's registrations) that lie inside it."""
        ranges = None if self._early is not None else held()
        records = []
        for index, tensor in enumerate(tensors):
            low = tensor.data_ptr()
            high = low + tensor.numel() * tensor.element_size()
            if self._early is not None:
                record = [(low + offset, size) for buffer, offset, size in self._early if buffer == index]
            else:
                record = [(ptr, size) for ptr, size in ranges if low <= ptr < high]
            setattr(tensor, RANGES_ATTR, record)
            records.append((tensor, record))
        self._records = records

    def clear(self, tensors) -> None:
        """Nothing of ``tensors`` is registered any more; later notes are dropped."""
        for tensor in tensors:
            setattr(tensor, RANGES_ATTR, [])
        self._records = []
