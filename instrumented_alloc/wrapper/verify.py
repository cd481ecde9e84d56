"""Immediate vs deferred verification of the slot tier, and argument validation.

Contract (``_Verification``, a mixin of ``InstrumentedAllocator``): ``_slot_tier(fn, *tensors)`` runs a check on
host views of index tensors: at once (immediate: CPU tensors), or in call order once their non-blocking copies
have landed (deferred: pinned copies with a CUDA event; ``_drain`` at ``step()``, ``flush()``, sweeps). Off the
CUDA path the copies are plain blocking ones. Writes ``_w_pending`` and the per-call ``op`` while draining."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from instrumented_alloc.argcheck import (
    ArgumentError,
)


class _Verification:
    """Slot-tier verification (see the module docstring)."""

    # -- slot tier plumbing -------------------------------------------------------------------------------------
    def _slot_tier(self, fn: Callable, *tensors) -> None:
        """Run ``fn`` on host views of ``tensors``: now (CPU, immediate) or, in call order, once their
        non-blocking copies have landed (deferred). Immediate mode may pass numpy arrays already on the host
        (what ``_swa_peer`` and ``_peers_at`` return there)."""
        if not self._w_deferred:
            if len(tensors) == 1:
                t = tensors[0]
                fn(t if type(t) is np.ndarray else t.numpy())
            else:
                fn(*(t if type(t) is np.ndarray else t.numpy() for t in tensors))
            return
        event = None
        if self._w_cuda and tensors:
            copies = []
            for t in tensors:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                copies.append(buf)
            # The copies run on the current stream of the tensors' own GPU, which need not be the current device
            # (an engine that never set_device to the allocator's GPU): the event goes on that stream, or it could
            # complete before the copies have.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensors[0].device))
        else:
            # The caller may reuse its tensor (a view of req_to_token) before the boundary: keep a copy.
            copies = [t.detach().to("cpu", copy=True) for t in tensors]
        self._w_pending.append((fn, copies, event, self._w_st.op))

    def _drain(self, *, wait: bool) -> None:
        pending = self._w_pending
        current = self._w_st.op
        while pending:
            fn, copies, event, op = pending[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
            pending.popleft()
            self._w_st.op = op  # the page updates this verification makes belong to the call that queued it
            fn(*(c.numpy() for c in copies))
            if self.bus.active:
                self._flush_deltas()
        self._w_st.op = current

    def _swa_peer(self, full_slots):
        """SWA peers of handed-out full slots, read after the call. Immediate mode (host tensors only): a numpy
        gather on a view of the mapping (a torch index costs microseconds of dispatch); deferred: a device op
        whose result the slot tier copies without a sync."""
        mapping = self._w_inner.full_to_swa_index_mapping
        if not self._w_deferred:
            return mapping.numpy()[full_slots.numpy().astype(np.int64, copy=False)]
        return mapping[full_slots.to(torch.int64)]

    # -- helpers -------------------------------------------------------------------------------------------
    def _validate(self, op: str, check: Callable, *args, **kwargs):
        try:
            return check(*args, **kwargs)
        except ArgumentError as exc:
            self._invalid(op, exc)

    def _invalid(self, op: str, exc: Exception, *, rid=None):
        self._violate("invalid_argument", f"{op}: {exc}", op=op, rid=rid)
        self._w_to_raise.clear()  # the argument error is what the caller gets, in every mode
        self._deliver()
        raise exc
