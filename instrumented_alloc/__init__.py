"""instrumented-alloc: an invariant-checking, observable wrapper for KV-cache page allocators.

The core package holds state and invariants only: no I/O, no exporter imports. Exporters subscribe to the
wrapper's events (see ``exporters/``).
"""

from instrumented_alloc.invariants import INVARIANTS, InvariantViolation, Violation
from instrumented_alloc.ledger import KvLedger, ReqKvInfo
from instrumented_alloc.wrapper import InstrumentedAllocator

__all__ = ["INVARIANTS", "InstrumentedAllocator", "InvariantViolation", "KvLedger", "ReqKvInfo", "Violation"]
__version__ = "0.1.0"
