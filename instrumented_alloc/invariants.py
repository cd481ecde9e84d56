"""The invariant catalog, the violation record, and the exception raise mode throws.

The ids are public: metric labels, alert rules, recordings and tests use them. Never rename one; add new ids.
"""

from __future__ import annotations

from dataclasses import dataclass

INVARIANTS: dict[str, str] = {
    "kv_allocated_len_page_aligned": "a request's kv_allocated_len is >= 0 and a multiple of page_size",
    "kv_committed_le_allocated": "kv_committed_len <= kv_allocated_len",
    "ledger_matches_pages": "pages a request owns == ceil(kv_allocated_len / page_size), minus SWA-evicted pages "
    "in the swa pool",
    "swa_evicted_seqlen_page_aligned": "swa_evicted_seqlen >= 0 and a multiple of page_size (the seed's I2)",
    "swa_evicted_seqlen_monotonic": "the SWA-evicted length of a live request never decreases",
    "swa_evicted_le_allocated": "swa_evicted_seqlen <= kv_allocated_len",
    "swa_evicted_within_window": "nothing inside the sliding window is evicted: "
    "swa_evicted_seqlen <= max(0, seq_len - window)",
    "reserved_page_touched": "page 0 / slot 0 is never handed out nor freed",
    "double_free": "a freed page is in use (not already free)",
    "free_unallocated": "a freed page was handed out by this pool and is in range",
    "duplicate_allocation": "a handed-out page is not already in use",
    "slot_page_alignment": "the slot of position i has slot % page_size == i % page_size",
    "alloc_length_mismatch": "an allocation returns exactly the requested number of slots",
    "segment_start_unaligned": "start_pos of a segment free is page-aligned",
    "pool_conservation": "free + staged + used == total pages, per pool",
    "request_leak": "a released request owns no pages; when idle, no page is owned by a finished request",
    "swa_mapping_inconsistent": "an SWA peer is mapped before free_swa and released before free_full; "
    "the mapping points at live SWA slots",
    "invalid_argument": "arguments have the documented dtype, device, shape and ranges",
}

# "critical": the pool itself is corrupted (KV of one request can be read or overwritten by another).
# "error": bookkeeping is wrong or a request is mis-sized; the pool is still consistent.
SEVERITY: dict[str, str] = {
    "kv_allocated_len_page_aligned": "error",
    "kv_committed_le_allocated": "error",
    "ledger_matches_pages": "error",
    "swa_evicted_seqlen_page_aligned": "error",
    "swa_evicted_seqlen_monotonic": "error",
    "swa_evicted_le_allocated": "error",
    "swa_evicted_within_window": "critical",
    "reserved_page_touched": "critical",
    "double_free": "critical",
    "free_unallocated": "critical",
    "duplicate_allocation": "critical",
    "slot_page_alignment": "critical",
    "alloc_length_mismatch": "critical",
    "segment_start_unaligned": "error",
    "pool_conservation": "critical",
    "request_leak": "error",
    "swa_mapping_inconsistent": "critical",
    "invalid_argument": "error",
}


@dataclass(frozen=True)
class Violation:
    """One broken invariant, as recorded, exported and replayed.

    ``message`` says what was expected and what was found, in numbers. ``rid`` is the request id when the
    violation concerns one request (None otherwise); ``step`` the wrapper's step counter when it was detected;
    ``op`` the allocator method (or ``ledger``, ``step``, ``sweep``, ``release``) where it was detected.
    """

    invariant: str
    message: str
    pool: str | None = None
    rid: object = None
    step: int = 0
    op: str = ""
    ts: float = 0.0
    trace_id: str | None = None
    severity: str = "error"

    def __str__(self) -> str:
        where = f" pool={self.pool}" if self.pool else ""
        who = f" rid={self.rid}" if self.rid is not None else ""
        return f"[{self.invariant}] {self.message} (op={self.op}{where}{who} step={self.step})"


class InvariantViolation(AssertionError):
    """Raised in ``mode="raise"`` after the violation was recorded and published.

    A subclass of AssertionError so that code written against the seed's bare ``assert`` still catches it.
    """

    def __init__(self, violation: Violation):
        super().__init__(str(violation))
        self.violation = violation

    @property
    def invariant(self) -> str:
        return self.violation.invariant
