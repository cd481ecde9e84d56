"""Argument validation shared by the reference allocators and the wrapper.

Contract:
- Every function here reads tensor *metadata* (type, dtype, device, shape) and the values of CPU tensors and
  Python ints only. Nothing here ever reads a device tensor's values, so validation never forces a
  device->host synchronisation.
- A failed check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong device, shape or
  range) whose message starts with the argument's name, before the caller has changed any state.
- ``ArgumentError`` mixes into both so callers can catch "bad argument" without catching allocator bugs.
"""

from __future__ import annotations

import numbers

import torch

_INDEX_DTYPES = (torch.int64, torch.int32)
_CPU = torch.device("cpu")


class ArgumentError(Exception):
    """Marker base: raised for a malformed call. Always combined with TypeError or ValueError."""

    def __init__(self, argument: str, message: str):
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class ArgumentTypeError(ArgumentError, TypeError):
    pass


class ArgumentValueError(ArgumentError, ValueError):
    pass


def same_device(a: torch.device, b: torch.device) -> bool:
    """Devices match when their types match and their indices do (a missing index matches index 0)."""
    if a.type != b.type:
        return False
    return (a.index or 0) == (b.index or 0)


def check_int(name: str, value, *, minimum: int = 0) -> int:
    """A Python (or numpy) integer, not a bool, not a tensor, >= minimum. Returns it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(name, f"expected an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ArgumentValueError(name, f"must be >= {minimum}, got {value}")
    return value


def check_index_tensor(name: str, t, device: torch.device) -> torch.Tensor:
    """A 1-D int32/int64 tensor on ``device``. Values are not read (they may live on an accelerator)."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise ArgumentTypeError(name, f"expected dtype int64 or int32, got {t.dtype}")
    if t.dim() != 1:
        raise ArgumentValueError(name, f"expected a 1-D tensor, got shape {tuple(t.shape)}")
    if not same_device(t.device, device):
        raise ArgumentValueError(name, f"expected a tensor on {device}, got one on {t.device}")
    return t


_DECODE = object()


def check_batch(
    device: torch.device,
    *,
    seq_lens,
    seq_lens_cpu,
    last_loc,
    prefix_lens=_DECODE,
    prefix_lens_cpu=_DECODE,
    extend_num_tokens=_DECODE,
) -> int:
    """Validate one extend or decode batch; returns the batch size.

    Device tensors (``prefix_lens``, ``seq_lens``, ``last_loc``) are checked by metadata only; the ``*_cpu``
    mirrors are checked by value: lengths are >= 0, ``prefix <= seq``, and ``extend_num_tokens`` equals
    ``sum(seq - prefix)`` (for decode, every ``seq_len >= 1``).
    """
    check_index_tensor("seq_lens", seq_lens, device)
    check_index_tensor("seq_lens_cpu", seq_lens_cpu, _CPU)
    check_index_tensor("last_loc", last_loc, device)
    bs = seq_lens.shape[0]
    for name, t in (("seq_lens_cpu", seq_lens_cpu), ("last_loc", last_loc)):
        if t.shape[0] != bs:
            raise ArgumentValueError(name, f"has {t.shape[0]} entries, seq_lens has {bs}")
    if prefix_lens is _DECODE:
        # decode: one new position per request, at seq_len - 1.
        if bs and int(seq_lens_cpu.min()) < 1:
            raise ArgumentValueError("seq_lens_cpu", f"decode needs every seq_len >= 1, got {seq_lens_cpu.tolist()}")
        return bs
    check_index_tensor("prefix_lens", prefix_lens, device)
    check_index_tensor("prefix_lens_cpu", prefix_lens_cpu, _CPU)
    for name, t in (("prefix_lens", prefix_lens), ("prefix_lens_cpu", prefix_lens_cpu)):
        if t.shape[0] != bs:
            raise ArgumentValueError(name, f"has {t.shape[0]} entries, seq_lens has {bs}")
    n = check_int("extend_num_tokens", extend_num_tokens)
    if bs:
        if int(seq_lens_cpu.min()) < 0:
            raise ArgumentValueError("seq_lens_cpu", f"negative length in {seq_lens_cpu.tolist()}")
        if int(prefix_lens_cpu.min()) < 0:
            raise ArgumentValueError("prefix_lens_cpu", f"negative length in {prefix_lens_cpu.tolist()}")
        ext = seq_lens_cpu.to(torch.int64) - prefix_lens_cpu.to(torch.int64)
        if int(ext.min()) < 0:
            bad = int(torch.nonzero(ext < 0)[0, 0])
            raise ArgumentValueError(
                "prefix_lens_cpu",
                f"request {bad}: prefix_len {int(prefix_lens_cpu[bad])} > seq_len {int(seq_lens_cpu[bad])}",
            )
        total = int(ext.sum())
    else:
        total = 0
    if total != n:
        raise ArgumentValueError("extend_num_tokens", f"is {n} but sum(seq_lens_cpu - prefix_lens_cpu) is {total}")
    return bs


def check_start_pos(value) -> int:
    return check_int("start_pos", value)


def check_segments(name: str, segments, device: torch.device) -> list:
    """A sequence of ``(free_index, start_pos)`` pairs (``free_segments``), each a 1-D int tensor on ``device`` and
    an int >= 0. Checked in full before anything is freed; returns the pairs as a list (a generator is consumed).
    Errors name ``name`` and say which segment and which part is wrong."""
    if isinstance(segments, (torch.Tensor, str, bytes)) or not hasattr(segments, "__iter__"):
        raise ArgumentTypeError(
            name, f"expected a sequence of (free_index, start_pos) pairs, got {type(segments).__name__}"
        )
    out = []
    for i, seg in enumerate(segments):
        if isinstance(seg, torch.Tensor) or not isinstance(seg, (tuple, list)) or len(seg) != 2:
            raise ArgumentTypeError(
                name, f"segment {i}: expected a (free_index, start_pos) pair, got {type(seg).__name__}"
            )
        free_index, start_pos = seg
        try:
            check_index_tensor("free_index", free_index, device)
            start_pos = check_start_pos(start_pos)
        except ArgumentError as exc:
            raise type(exc)(name, f"segment {i}: {exc}") from None
        out.append((free_index, start_pos))
    return out
