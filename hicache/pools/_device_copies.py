"""The host<->device copies of a host pool (issue #34 item 2: the transfer machinery apart from the
SGLang edge and the pages): `Stream`, one copy lane; `DeviceCopies`, the part that does SGLang's
per-layer load and all-layer backup in the pool's own terms - which device tensors (the form's
`own_device`), which host layers (the form's `mapped_layers`), this rank's DCP rows - over the
geometry and lanes it is given; `DeviceCopiesMixin`, SGLang's names for them plus 0.5.23's L2
hooks, each handed to the part. The copying itself is `_transfer.Transfers`' (bounds-checked
batches through the copy engine).
"""

from __future__ import annotations

import operator
import threading
from typing import NamedTuple

from hicache.errors import RegistrationStateError, TransferError
from hicache.plan.checks import is_integer
from hicache.pools._transfer import check_backend
from hicache.pools._views import layer_token_view


class Stream(NamedTuple):
    """One host<->device copy stream: a host buffer (and K/V half) and its device tensor."""

    buffer: int
    kv: int | None
    device: object  # callable(device_pool, layer) -> device tensor for that layer
    rows: bool = False  # whole page rows (DSA, DeepSeek-V4) instead of token slots


def _layer_id(layer_id) -> int:
    """A controller's layer id as an int (numpy/torch integers count; a bool does not)."""
    if not is_integer(layer_id):
        raise TransferError(f"layer_id must be an integer, got {layer_id!r} ({type(layer_id).__name__})")
    return operator.index(layer_id)


class CopiesInFlight:
    """The transfers a pool has running, so that its destroy() lets no memory go under one:
    `enter` counts a transfer in (refused once closing), `leave` counts it out, `drain` refuses
    new ones and waits for those in flight."""

    def __init__(self, name: str) -> None:
        self.name, self.count, self.closing = name, 0, False
        self._gate = threading.Condition()

    def enter(self, alive) -> None:
        """Count one transfer in, after ``alive()`` (the pool's state check) passes."""
        with self._gate:
            alive()
            if self.closing:
                raise RegistrationStateError(f"{self.name} is being destroyed: no new transfer starts")
            self.count += 1

    def leave(self) -> None:
        with self._gate:
            self.count -= 1
            if not self.count:
                self._gate.notify_all()

    def drain(self) -> None:
        """Refuse new transfers and wait for those in flight: a host copy still running, or a
        launch about to enqueue work on memory about to be unregistered (interruptible; a
        second destroy() waits again)."""
        with self._gate:
            self.closing = True
            while self.count:
                self._gate.wait(0.1)


class DeviceCopies:
    """A part of a host pool (issue #55 item 1): SGLang's per-layer load and all-layer backup in
    the pool's own terms, over what it is given - the pool's ``geometry`` (which device tensors:
    the form's `own_device`; which host layers: its `mapped_layers`; this rank's DCP rows), its
    copy lanes (``transfers``, a `_transfer.Transfers`; None: an allocator-only pool), the count
    of copies in flight (``in_flight``, which destroy() drains) and the pool's state check
    (``alive``)."""

    def __init__(self, name: str, geometry, transfers, in_flight: CopiesInFlight, alive) -> None:
        self.name, self.geometry, self.transfers = name, geometry, transfers
        self.in_flight, self.alive = in_flight, alive

    def load(self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft: bool) -> None:
        """One layer host -> device (the host layer a controller's ``layer_id`` maps to, if any)."""
        host = self.geometry.host_layer(_layer_id(layer_id), is_draft=is_draft)
        if host is not None:
            self._transfer(device_pool, host_indices, device_indices, [host], io_backend, to_host=False)

    def backup(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Every layer device -> host."""
        self._transfer(device_pool, host_indices, device_indices, range(self.geometry.layer_num), io_backend,
                       to_host=True)

    def _transfer(self, device_pool, host_indices, device_indices, layers, io_backend, *, to_host: bool) -> None:
        in_flight = self.in_flight
        in_flight.enter(self.alive)  # counted, so destroy() waits for it before letting memory go
        try:
            self._transfer_now(device_pool, host_indices, device_indices, layers, io_backend, to_host=to_host)
        finally:
            in_flight.leave()

    def _transfer_now(self, device_pool, host_indices, device_indices, layers, io_backend, *, to_host: bool) -> None:
        if self.transfers is None:
            raise RegistrationStateError(f"{self.name} is allocator-only (is_dummy): it holds no memory to copy")
        geometry = self.geometry
        if io_backend not in ("direct", "kernel"):  # the layout was checked when the pool was built
            check_backend(io_backend, geometry.layout, geometry.descriptor.supported())
        if geometry.form.own_device:
            # the device buffers given at construction, whatever pool the caller passes (SGLang's
            # own pools copy to the captured tensors too); this rank's rows under DCP
            device_pool = geometry.device
            host_indices, device_indices = (self._dcp_rows(host_indices), self._dcp_rows(device_indices))
        self.transfers.run(device_pool, host_indices, device_indices, layers, to_host=to_host)

    def _dcp_rows(self, indices):
        """SGLang's `maybe_dcp_kernel_indices`: widened logical slots -> this rank's rows (slot %
        dcp_size == dcp_rank owns row slot // dcp_size)."""
        size = self.geometry.dcp_size
        if size == 1:
            return indices
        return indices[self.geometry.dcp_rank :: size] // size


def host_view(buffers: list, geometry, stream: Stream, layer: int):
    """The host tensor one copy lane reads or writes for ``layer`` (`_views.layer_token_view`)."""
    return layer_token_view(buffers[stream.buffer], geometry.family, geometry.layout, layer, stream.kv,
                            geometry.page_size)


class DeviceCopiesMixin:
    """SGLang's transfer calls on a `HostKVCache`, each handed to its `DeviceCopies` part."""

    #: the pool's state these calls read: only the part (tests/test_import_rules.py)
    NEEDS = ("_copies",)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:
        """Copy the given slots of one layer host -> device (``is_draft``: a packed MTP draft
        layer, SGLang 0.5.23)."""
        self._copies.load(device_pool, host_indices, device_indices, layer_id, io_backend, is_draft)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Copy the given slots of every layer device -> host."""
        self._copies.backup(device_pool, host_indices, device_indices, io_backend)

    # -- SGLang 0.5.23's L2 hooks (pool_host/base.py; called by mem_cache/l2_transfer.py) ---
    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        """Indices as the transfer uses them: physical already (no compacting layout here)."""
        return host_indices, device_indices

    def backup_from_device_all_layer_physical(self, device_pool, host_indices, device_indices, io_backend) -> None:
        self.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def load_to_device_per_layer_physical(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                          is_draft: bool = False) -> None:
        self.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                      is_draft=is_draft)
