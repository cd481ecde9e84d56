"""Faults injected into a real SGLang engine through test-only hooks: what tests and ``demo --engine sglang
--inject`` use to show that the wrapper names the engine's errors.

``KVALLOC_INJECT`` names the faults to arm (comma-separated). An armed fault changes what SGLang does for the
requests whose id starts with ``inject-<fault>`` (``TAG``), and for no other: one engine serves clean traffic and
faulty requests side by side. With none armed no hook is installed.

- ``leak``: releases the request without freeing its KV row (``free_kv_row`` skipped): ``request_leak`` at the
  release.
- ``no-release``: drops the finished request without releasing its KV at all: ``request_leak`` at the idle sweep
  (SGLang's own idle check then counts the pages).
- ``double-free``: frees the request's KV row twice in its release: ``double_free``.
- ``cache-twice``: hands the request's pages to the prefix cache, forgets it did, hands them again: ``double_free``.
- ``swa-misaligned``: writes an SWA evicted length one token past a page boundary: ``swa_evicted_seqlen_page_aligned``.
- ``prealloc-tail``: PD decode prealloc with an SWA tail one token short (the seed's case):
  ``swa_evicted_seqlen_page_aligned``.
"""

from __future__ import annotations

import contextlib

from instrumented_alloc.sglang_plugin import session

FAULTS = {
    "leak": "request_leak",
    "no-release": "request_leak",
    "double-free": "double_free",
    "cache-twice": "double_free",
    "swa-misaligned": "swa_evicted_seqlen_page_aligned",
    "prealloc-tail": "swa_evicted_seqlen_page_aligned",
}


class FaultError(ValueError):
    """An unknown fault name."""


def tag(fault: str) -> str:
    """The request id prefix that selects the requests a fault acts on."""
    return f"inject-{fault}"


def _targets(req, fault: str) -> bool:
    return isinstance(req.rid, str) and req.rid.startswith(tag(fault))


@contextlib.contextmanager
def _patched(obj, name: str, replacement):
    original = getattr(obj, name)
    setattr(obj, name, replacement(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def _release(armed):
    def around_release(original, req, tree_cache, *args, **kwargs):
        if "no-release" in armed and _targets(req, "no-release"):
            return None
        if "leak" in armed and _targets(req, "leak"):
            with _patched(tree_cache, "free_kv_row", lambda free: lambda kv, ranges: None):
                return original(req, tree_cache, *args, **kwargs)
        if "double-free" in armed and _targets(req, "double-free"):

            def twice(free):
                def free_kv_row(kv, ranges):
                    free(kv, ranges)
                    free(kv, ranges)

                return free_kv_row

            with _patched(tree_cache, "free_kv_row", twice):
                return original(req, tree_cache, *args, **kwargs)
        if "cache-twice" in armed and _targets(req, "cache-twice") and kwargs.get("checkpoint", True):
            kv = req.kv
            p0 = kv.cache_protected_len
            req.refresh_fill_ids()
            tree_cache.checkpoint(req, up_to=req.owned_kv_len())
            kv.cache_protected_len = p0  # the engine forgets that it handed the pages over
        return original(req, tree_cache, *args, **kwargs)

    return around_release


def _set_evicted(original, kv, component_type, length, *args, **kwargs):
    sess = session.current()
    rid = sess.kv_rid.get(id(kv)) if sess is not None else None
    if (
        isinstance(rid, str)
        and rid.startswith(tag("swa-misaligned"))
        and getattr(component_type, "name", None) == "SWA"
        and length > kv.get_evicted_seqlen(component_type)
    ):
        length += 1
    return original(kv, component_type, length, *args, **kwargs)


def _prealloc(original, allocator, *args, **kwargs):
    req = kwargs.get("req")
    if req is not None and _targets(req, "prealloc-tail") and kwargs.get("uses_swa_tail") and kwargs["swa_tail_len"]:
        kwargs["swa_tail_len"] -= 1
    return original(allocator, *args, **kwargs)


def hooks(names) -> tuple:
    """The registry hooks (target, type, hook) that arm ``names``; empty when none is named."""
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise FaultError(
            f"instrumented-alloc: KVALLOC_INJECT: unknown faults {', '.join(unknown)} (known: {', '.join(FAULTS)})"
        )
    armed = frozenset(names)
    if not armed:
        return ()
    table = [("sglang.srt.mem_cache.common.release_kv_cache", "AROUND", _release(armed))]
    if "swa-misaligned" in armed:
        table.append(("sglang.srt.managers.schedule_batch.ReqKvInfo.set_evicted_seqlen", "AROUND", _set_evicted))
    if "prealloc-tail" in armed:
        table.append(("sglang.srt.disaggregation.decode.alloc_for_decode_prealloc", "AROUND", _prealloc))
    return tuple(table)
