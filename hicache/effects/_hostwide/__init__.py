"""The host-wide coordination room: what processes sharing this host agree through, below
``_cuda`` and ``_bringup`` (issue #34 item 6) - the private runtime directory (`_rundir`), the
budget lock and its ledger of claims (`_lock`), and the registration turnstile (`_turnstile`).
Leaves only (``_interrupts``, ``_trace``) below it; the transaction (``_cuda._executor``) and
the bring-up use it, never the other way round."""
