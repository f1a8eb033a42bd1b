"""A hypothesis state machine over apply / release / failures / restart on the fake runtime.

Invariant: what the fake CUDA holds is exactly the union of the active registrations' ranges
and the ranges reported leaked - after every step, whatever failed.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.effects import HostLedger
from hicache.effects import apply_plan
from hicache.errors import (
    ApplyError,
    HostAlreadyRegisteredError,
    ReleaseError,
    RollbackError,
)
from hicache.testing import FakeRuntime
from tests.strategies import fault_codes, registration_plans

BASE, SLOT = 1 << 40, 1 << 32
plans, codes = registration_plans, fault_codes


class ExecutorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.active: dict[int, object] = {}
        self.restart()

    def _release_all(self) -> None:
        for registration in self.active.values():
            try:
                registration.release()
            except ReleaseError:
                pass  # a poisoned context: the process is about to go

    @rule()
    def restart(self) -> None:
        """A new process: fresh CUDA state, nothing held."""
        self._release_all()
        self.runtime = FakeRuntime()
        self.ledger = HostLedger()
        self.active: dict[int, object] = {}
        self.leaked: set[tuple[int, int]] = set()
        self.maybe: set[tuple[int, int]] = set()  # an interrupted unregister: may be undone

    def _expected(self) -> set[tuple[int, int]]:
        held = set(self.leaked)
        for registration in self.active.values():
            held |= {(r.ptr, r.size) for r in registration.ranges}
        return held

    @rule(
        plan=plans, slot=st.integers(0, 3), fail_at=st.none() | st.integers(0, 5),
        code=codes, interrupt_at=st.none() | st.integers(0, 5),
        when=st.sampled_from(["before", "after"]), undo_fail=st.none() | st.integers(0, 3),
        undo_code=codes, halvings=st.integers(0, 2),
    )
    def apply(self, plan, slot, fail_at, code, interrupt_at, when, undo_fail, undo_code, halvings):
        cudart = self.runtime.cudart
        if fail_at is not None:
            cudart.fail_register = {cudart.register_calls + fail_at: code}
        if interrupt_at is not None:
            cudart.interrupt_register = {cudart.register_calls + interrupt_at: when}
        if undo_fail is not None:
            cudart.fail_unregister = {cudart.unregister_calls + undo_fail: undo_code}
        before = self.runtime.held()
        try:
            registration = apply_plan(
                plan, base_ptr=BASE + slot * SLOT, runtime=self.runtime, ledger=self.ledger,
                retry_halvings=halvings,
            )
        except HostAlreadyRegisteredError:
            assert self.runtime.held() == before  # refused before CUDA
        except RollbackError as error:
            assert error.leaked or error.uncertain
            new = self.runtime.held() - before
            # exactly .leaked, plus the interrupted call only if it really took effect
            assert set(error.leaked) <= new <= set(error.leaked) | set(error.uncertain)
            self.leaked |= new
        except ApplyError:
            assert self.runtime.held() == before  # fully undone
        else:
            assert slot not in self.active
            self.active[slot] = registration
            assert sum(r.size for r in registration.ranges) == plan.total_bytes
        finally:
            cudart.fail_register, cudart.interrupt_register, cudart.fail_unregister = {}, {}, {}

    @precondition(lambda self: self.active)
    @rule(
        data=st.data(), undo_fail=st.none() | st.integers(0, 3), undo_code=codes,
        interrupt_at=st.none() | st.integers(0, 3), when=st.sampled_from(["before", "after"]),
    )
    def release(self, data, undo_fail, undo_code, interrupt_at, when):
        slot = data.draw(st.sampled_from(sorted(self.active)))
        registration = self.active.pop(slot)
        cudart = self.runtime.cudart
        if undo_fail is not None:
            cudart.fail_unregister = {cudart.unregister_calls + undo_fail: undo_code}
        if interrupt_at is not None:
            cudart.interrupt_unregister = {cudart.unregister_calls + interrupt_at: when}
        try:
            registration.release()
        except ReleaseError as error:
            self.leaked |= set(error.leaked)
        except KeyboardInterrupt:
            # counted as leaked by the registration; really pinned only if it came "before"
            self.maybe |= set(registration.status().leaked)
        finally:
            cudart.fail_unregister, cudart.interrupt_unregister = {}, {}
        state = registration.status().state
        assert state in ("released", "leaked")
        if state == "released":
            registration.release()  # idempotent: no call, no error

    @invariant()
    def cuda_holds_exactly_what_we_say(self):
        held, expected = self.runtime.held(), self._expected()
        assert expected <= held <= expected | self.maybe
        assert set(self.ledger.held()) >= self.leaked | self.maybe  # never reused or freed
        self.runtime.check_valid()

    def teardown(self):
        self._release_all()


TestExecutorMachine = ExecutorMachine.TestCase
