"""``InstrumentedAllocator``: a drop-in wrapper that checks every invariant of a KV page allocator, per request,
on every call, and turns each failure into a structured ``Violation``.

Contracts:
- Drop-in: same methods, arguments and return values as the inner allocator (ours or SGLang's own classes,
  duck-typed). Every other attribute is forwarded untouched, reads and writes. The wrapper is an instance of a
  generated subclass of ``type(inner)``, so ``isinstance(wrapped, SWATokenToKVPoolAllocator)`` takes the same
  branch as the bare allocator does (SGLang's scheduler branches on it).
- Results: for every well-formed call the inner allocator runs exactly the call it was given, in every mode, so
  results and inner state are bit-identical to a bare allocator's run of the same calls. In ``mode="raise"`` a
  free whose indices are on the host and break an invariant is refused before it reaches the inner allocator;
  everything else is checked after the call.
- Malformed calls (wrong type, dtype, device or shape; negative lengths; prefix > seq) are never forwarded (in any
  mode but off): recorded as ``invalid_argument``, then ``TypeError``/``ValueError`` naming the argument.
- No device sync: the host tier reads only ``*_cpu`` tensors, Python ints and tensor metadata; the slot tier reads
  handed-out / freed indices at once on the host, or from non-blocking copies at the next ``step()`` whose copies
  are complete (``verify``: see ``verify.py``).
- Threading: every instrumented call holds the wrapper's lock; sinks get the events of one call as one batch
  after the call, and a failing sink never reaches the caller.

Modules, one job each: ``core`` (the public class: construction, configuration, public attributes),
``forwarding`` (attribute forwarding to the inner allocator), ``state`` (the per-call state and small call
plumbing), ``alloc`` / ``extend`` / ``decode`` / ``frees`` / ``free_parts`` / ``pools`` (the checks per
operation family), ``verify`` (immediate vs deferred verification), ``sweeps`` (step boundaries and full sweeps),
``emit`` (building and delivering events, reporting violations), ``requests`` (bindings, prefix-cache handoffs,
releases, checked ledger writes), ``constants``.
"""

from instrumented_alloc.wrapper.constants import ALLOCATED_LEN, FAST_PATHS, INSTRUMENTED_OPS, MODES, VERIFY
from instrumented_alloc.wrapper.core import InstrumentedAllocator

__all__ = ["ALLOCATED_LEN", "FAST_PATHS", "INSTRUMENTED_OPS", "MODES", "VERIFY", "InstrumentedAllocator"]
