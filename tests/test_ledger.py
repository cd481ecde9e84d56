"""KvLedger standalone: every ledger rule at its boundaries, the single checked write point (a rejected value is
never stored), argument types, slot reuse, leaked slots, growth and the mapping protocol.

A ledger that stands alone (no wrapper) raises ``InvariantViolation`` for the first broken rule of a write.
"""

from __future__ import annotations

import numpy as np
import pytest

from instrumented_alloc import InvariantViolation, KvLedger, ReqKvInfo
from instrumented_alloc.invariants import SEVERITY

PS = 4


def ledger(window=None, **kwargs) -> KvLedger:
    return KvLedger(PS, sliding_window=window, **kwargs)


def values(kv: ReqKvInfo) -> tuple[int, int, int]:
    return kv.kv_allocated_len, kv.kv_committed_len, kv.swa_evicted_seqlen


def rejected(kv: ReqKvInfo, field: str, value, invariant: str) -> InvariantViolation:
    """Write ``value``; it must raise ``invariant`` for this request and leave every field as it was."""
    before = values(kv)
    with pytest.raises(InvariantViolation) as info:
        setattr(kv, field, value)
    assert info.value.invariant == invariant, str(info.value)
    assert info.value.violation.rid == kv.rid
    assert info.value.violation.op == "ledger"
    assert values(kv) == before  # the rejected value was never stored
    return info.value


def make(led: KvLedger, rid, allocated=0, committed=0, evicted=0) -> ReqKvInfo:
    kv = led.get_or_create(rid)
    kv.kv_allocated_len = allocated
    kv.kv_committed_len = committed
    kv.swa_evicted_seqlen = evicted
    assert values(kv) == (allocated, committed, evicted)
    return kv


# -- kv_allocated_len ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, PS, 2 * PS, 64 * PS])
def test_allocated_multiple_of_page_accepted(value):
    kv = ledger().get_or_create("a")
    kv.kv_allocated_len = value
    assert kv.kv_allocated_len == value


@pytest.mark.parametrize("value", [1, PS - 1, PS + 1, 2 * PS - 1, -PS, -1])
def test_allocated_unaligned_or_negative_rejected(value):
    kv = make(ledger(), "a", allocated=2 * PS) if value >= 0 else ledger().get_or_create("a")
    if value < 0:
        # committed 0 > -PS as well: two rules broken, the first one (alignment/sign) is what is raised.
        assert [i for i, _ in kv._ledger.check(kv.slot, "kv_allocated_len", value)] == [
            "kv_allocated_len_page_aligned",
            "kv_committed_le_allocated",
            "swa_evicted_le_allocated",
        ]
    exc = rejected(kv, "kv_allocated_len", value, "kv_allocated_len_page_aligned")
    assert f"kv_allocated_len={value}" in exc.violation.message
    assert f"remainder {value % PS}" in exc.violation.message


def test_allocated_below_committed_rejected_equal_accepted():
    kv = make(ledger(), "a", allocated=3 * PS, committed=2 * PS)
    kv.kv_allocated_len = 2 * PS  # committed == allocated is allowed
    assert values(kv) == (2 * PS, 2 * PS, 0)
    exc = rejected(kv, "kv_allocated_len", PS, "kv_committed_le_allocated")
    assert exc.violation.message == f"kv_allocated_len={PS} < kv_committed_len={2 * PS}; kept {2 * PS}"


def test_allocated_below_evicted_rejected():
    kv = make(ledger(), "a", allocated=4 * PS, committed=PS, evicted=2 * PS)
    kv.kv_allocated_len = 2 * PS  # evicted == allocated is allowed
    exc = rejected(kv, "kv_allocated_len", PS, "swa_evicted_le_allocated")
    assert exc.violation.message == f"kv_allocated_len={PS} < swa_evicted_seqlen={2 * PS}; kept {2 * PS}"


def test_allocated_unaligned_and_below_committed_reports_alignment_first():
    kv = make(ledger(), "a", allocated=3 * PS, committed=3 * PS)
    led = kv._ledger
    assert [i for i, _ in led.check(kv.slot, "kv_allocated_len", PS + 1)] == [
        "kv_allocated_len_page_aligned",
        "kv_committed_le_allocated",
    ]
    rejected(kv, "kv_allocated_len", PS + 1, "kv_allocated_len_page_aligned")


# -- kv_committed_len ------------------------------------------------------------------------------------------
def test_committed_bounds():
    kv = make(ledger(), "a", allocated=2 * PS)
    for v in (0, 1, PS + 1, 2 * PS):  # anything in 0..allocated, aligned or not
        kv.kv_committed_len = v
        assert kv.kv_committed_len == v
    exc = rejected(kv, "kv_committed_len", 2 * PS + 1, "kv_committed_le_allocated")
    assert (
        exc.violation.message
        == f"kv_committed_len={2 * PS + 1} is not within 0..kv_allocated_len={2 * PS}; kept {2 * PS}"
    )
    rejected(kv, "kv_committed_len", -1, "kv_committed_le_allocated")
    assert kv.kv_committed_len == 2 * PS


def test_committed_on_fresh_request_only_zero():
    kv = ledger().get_or_create("a")
    kv.kv_committed_len = 0
    rejected(kv, "kv_committed_len", 1, "kv_committed_le_allocated")


# -- swa_evicted_seqlen, no window -----------------------------------------------------------------------------
def test_evicted_aligned_monotonic_le_allocated_without_window():
    kv = make(ledger(), "a", allocated=4 * PS, committed=4 * PS)
    kv.swa_evicted_seqlen = 0  # unchanged: allowed
    kv.swa_evicted_seqlen = PS
    kv.swa_evicted_seqlen = PS  # equal: monotonic allows it
    kv.swa_evicted_seqlen = 4 * PS  # == allocated: allowed when there is no window
    assert values(kv) == (4 * PS, 4 * PS, 4 * PS)
    exc = rejected(kv, "swa_evicted_seqlen", 5 * PS, "swa_evicted_le_allocated")
    assert exc.violation.message == f"swa_evicted_seqlen={5 * PS} > kv_allocated_len={4 * PS}; kept {4 * PS}"
    exc = rejected(kv, "swa_evicted_seqlen", 3 * PS, "swa_evicted_seqlen_monotonic")
    assert exc.violation.message == f"swa_evicted_seqlen would decrease from {4 * PS} to {3 * PS}"


@pytest.mark.parametrize("value", [1, PS - 1, PS + 1, 3 * PS - 2])
def test_evicted_unaligned_rejected(value):
    kv = make(ledger(), "a", allocated=4 * PS, committed=4 * PS)
    exc = rejected(kv, "swa_evicted_seqlen", value, "swa_evicted_seqlen_page_aligned")
    assert exc.violation.message == (
        f"swa_evicted_seqlen={value} is not a non-negative multiple of page_size={PS} (remainder {value % PS}); kept 0"
    )


def test_evicted_negative_reports_alignment_before_monotonic():
    kv = make(ledger(), "a", allocated=4 * PS, committed=4 * PS)
    assert [i for i, _ in kv._ledger.check(kv.slot, "swa_evicted_seqlen", -PS)] == [
        "swa_evicted_seqlen_page_aligned",
        "swa_evicted_seqlen_monotonic",
    ]
    rejected(kv, "swa_evicted_seqlen", -PS, "swa_evicted_seqlen_page_aligned")


def test_evicted_decrease_and_unaligned_reports_alignment_first():
    kv = make(ledger(), "a", allocated=4 * PS, committed=4 * PS, evicted=2 * PS)
    assert [i for i, _ in kv._ledger.check(kv.slot, "swa_evicted_seqlen", PS + 2)] == [
        "swa_evicted_seqlen_page_aligned",
        "swa_evicted_seqlen_monotonic",
    ]
    rejected(kv, "swa_evicted_seqlen", PS + 2, "swa_evicted_seqlen_page_aligned")


# -- swa_evicted_seqlen with a window --------------------------------------------------------------------------
WINDOW = 2 * PS


@pytest.mark.parametrize("seq", [0, 1, WINDOW - 1, WINDOW, WINDOW + 1, WINDOW + PS, 5 * PS, 5 * PS + 3])
def test_evicted_within_window_boundary(seq):
    allocated = -(-(seq + 2 * PS) // PS) * PS  # room beyond the window, so only the window rule can fire
    kv = make(ledger(WINDOW), "a", allocated=allocated, committed=seq)
    limit = max(0, seq - WINDOW) // PS * PS  # the largest page-aligned value the window allows
    kv.swa_evicted_seqlen = limit
    assert kv.swa_evicted_seqlen == limit
    over = limit + PS
    exc = rejected(kv, "swa_evicted_seqlen", over, "swa_evicted_within_window")
    assert exc.violation.message == (
        f"swa_evicted_seqlen={over} reaches into the window: seq_len={seq}, window={WINDOW}, "
        f"at most {max(0, seq - WINDOW)} may be evicted"
    )


def test_evicted_exactly_max_seq_minus_window_allowed():
    kv = make(ledger(WINDOW), "a", allocated=6 * PS, committed=6 * PS)
    kv.swa_evicted_seqlen = 6 * PS - WINDOW  # == max(0, seq - window)
    assert kv.swa_evicted_seqlen == 4 * PS


def test_window_rule_replaces_nothing_le_allocated_still_checked():
    # committed <= allocated, so within-window implies <= allocated; both are listed when both break.
    kv = make(ledger(WINDOW), "a", allocated=3 * PS, committed=3 * PS)
    assert [i for i, _ in kv._ledger.check(kv.slot, "swa_evicted_seqlen", 4 * PS)] == [
        "swa_evicted_le_allocated",
        "swa_evicted_within_window",
    ]
    rejected(kv, "swa_evicted_seqlen", 4 * PS, "swa_evicted_le_allocated")


def test_unaligned_and_inside_window_reports_alignment_first():
    kv = make(ledger(WINDOW), "a", allocated=5 * PS, committed=5 * PS)  # at most 3*PS may be evicted
    assert [i for i, _ in kv._ledger.check(kv.slot, "swa_evicted_seqlen", 4 * PS - 1)] == [
        "swa_evicted_seqlen_page_aligned",
        "swa_evicted_within_window",
    ]
    rejected(kv, "swa_evicted_seqlen", 4 * PS - 1, "swa_evicted_seqlen_page_aligned")


def test_standalone_violation_carries_catalog_severity():
    kv = make(ledger(WINDOW), "a", allocated=5 * PS, committed=5 * PS)
    exc = rejected(kv, "swa_evicted_seqlen", 4 * PS, "swa_evicted_within_window")
    assert exc.violation.severity == SEVERITY["swa_evicted_within_window"] == "critical"


# -- argument types --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["kv_allocated_len", "kv_committed_len", "swa_evicted_seqlen"])
@pytest.mark.parametrize("value", [True, False, 4.0, "4", None, np.float64(4.0)])
def test_non_int_raises_type_error_naming_field(field, value):
    kv = make(ledger(), "a", allocated=4 * PS, committed=4 * PS, evicted=PS)
    before = values(kv)
    with pytest.raises(TypeError) as info:
        setattr(kv, field, value)
    assert not isinstance(info.value, InvariantViolation)
    assert str(info.value) == f"{field}: expected an int, got {type(value).__name__}"
    assert values(kv) == before


def test_numpy_integers_accepted_and_stored_as_int():
    kv = ledger().get_or_create("a")
    kv.kv_allocated_len = np.int64(2 * PS)
    kv.kv_committed_len = np.int32(5)
    kv.swa_evicted_seqlen = np.uint8(PS)
    assert values(kv) == (2 * PS, 5, PS)
    assert all(type(v) is int for v in values(kv))


# -- slots, release, growth ------------------------------------------------------------------------------------
def test_slot_reuse_after_release():
    led = ledger()
    a = make(led, "a", allocated=2 * PS, committed=5, evicted=PS)
    b = make(led, "b", allocated=PS, committed=1)
    assert (a.slot, b.slot) == (0, 1)
    assert led.release("a", leaked=False) == 0
    assert "a" not in led and len(led) == 1
    assert led.rid_of(0) is None
    c = led.get_or_create("c")
    assert c.slot == 0  # the released slot is reused
    assert values(c) == (0, 0, 0)  # and it starts empty
    assert led.rid_of(0) == "c"
    assert values(b) == (PS, 1, 0)
    # The reused slot starts a fresh history: monotonic is judged from 0, not from a's old value.
    c.kv_allocated_len = PS
    c.kv_committed_len = PS
    c.swa_evicted_seqlen = 0


def test_leaked_release_keeps_slot_out_of_reuse():
    led = ledger()
    make(led, "a", allocated=2 * PS, committed=2 * PS, evicted=PS)
    assert led.release("a", leaked=True) == 0
    assert "a" not in led
    assert bool(led.leaked[0]) is True
    assert bool(led.live[0]) is False
    assert led.rid_of(0) == "a"  # its pages still name it
    assert (int(led.allocated[0]), int(led.committed[0]), int(led.evicted[0])) == (2 * PS, 2 * PS, PS)
    slots = [led.get_or_create(f"n{i}").slot for i in range(300)]  # through a growth, too
    assert 0 not in slots
    assert sorted(slots) == list(range(1, 301))


def test_growth_past_initial_capacity_keeps_every_value():
    led = ledger(capacity=256)
    assert led.capacity == 256
    n = 300
    for i in range(n):
        make(led, f"r{i}", allocated=PS * (i // 3 + 1), committed=i // 3, evicted=PS * (i // 12))
    assert led.capacity == 512
    assert len(led) == n
    for i in range(n):
        kv = led[f"r{i}"]
        assert kv.slot == i
        assert values(kv) == (PS * (i // 3 + 1), i // 3, PS * (i // 12))
    assert sorted(led.live_slots().tolist()) == list(range(n))
    assert led.owned["full"].shape == (512,)
    assert int(led.owned["full"].sum()) == 0


def test_growth_from_tiny_capacity():
    led = ledger(capacity=1)
    for i in range(5):
        make(led, i, allocated=PS * (i + 1), committed=i)
    assert led.capacity == 8
    assert [values(led[i]) for i in range(5)] == [(PS * (i + 1), i, 0) for i in range(5)]


# -- mapping protocol ------------------------------------------------------------------------------------------
def test_mapping_protocol():
    led = ledger()
    assert len(led) == 0 and list(led) == [] and "a" not in led
    kv = led.get_or_create("a")
    assert isinstance(kv, ReqKvInfo) and kv.rid == "a" and kv.slot == 0
    again = led.get_or_create("a")
    assert again.slot == 0 and len(led) == 1  # get_or_create of a known rid returns the same slot
    led.get_or_create(("tuple", 7))
    led.get_or_create(42)
    assert "a" in led and ("tuple", 7) in led and 42 in led
    assert len(led) == 3
    assert list(led) == ["a", ("tuple", 7), 42]
    # Iterating over a copy: releasing while iterating is safe.
    for rid in led:
        led.release(rid, leaked=False)
    assert len(led) == 0
    assert repr(kv) == "ReqKvInfo(rid='a', kv_allocated_len=0, kv_committed_len=0, swa_evicted_seqlen=0)"


def test_getitem_unknown_raises_keyerror_and_creates_nothing():
    led = ledger()
    led.get_or_create("a")
    with pytest.raises(KeyError) as info:
        led["nope"]
    assert info.value.args == ("nope",)
    assert "nope" not in led and len(led) == 1
    with pytest.raises(KeyError):
        led.release("nope", leaked=False)


def test_live_slots():
    led = ledger()
    assert led.live_slots().tolist() == []
    for rid in "abcd":
        led.get_or_create(rid)
    assert led.live_slots().tolist() == [0, 1, 2, 3]
    led.release("b", leaked=False)
    led.release("c", leaked=True)
    assert led.live_slots().tolist() == [0, 3]
    led.get_or_create("e")  # reuses b's slot 1, not leaked c's slot 2
    assert sorted(led.live_slots().tolist()) == [0, 1, 3]
    assert led.live_slots().dtype == np.int64
    assert led.live[[0, 1, 2, 3]].tolist() == [True, True, False, True]


def test_view_reads_the_columns():
    led = ledger()
    kv = make(led, "a", allocated=3 * PS, committed=7, evicted=PS)
    assert (int(led.allocated[kv.slot]), int(led.committed[kv.slot]), int(led.evicted[kv.slot])) == (3 * PS, 7, PS)
    led.reset(kv.slot)
    assert values(kv) == (0, 0, 0)


def test_decode_steps_count_runs_of_one_batch_and_restart_with_a_reused_slot():
    led = KvLedger(4)
    a, b = led.slots_of(["a", "b"]), led.slots_of(["b"])
    for _ in range(3):
        led.count_decodes(a)  # one run: counted without a column write
    led.count_decodes(b)  # another batch: the run is added first
    assert led.decode_steps[led.slot_of("a")] == 3 and led.decode_steps[led.slot_of("b")] == 4
    led.count_decodes(a)
    slot = led.release("a", leaked=False)  # a pending run naming a released slot is added before it is zeroed
    assert led.decode_steps[slot] == 0 and led.decode_steps[led.slot_of("b")] == 5
    assert led.slot_of("c") == slot and led.decode_steps[slot] == 0  # the slot's next request starts at 0
