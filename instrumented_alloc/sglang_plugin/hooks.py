"""Where the plugin hooks SGLang 0.5.23, and the check that every hook took.

Each hook is registered with SGLang's ``HookRegistry`` and applied at once (``apply_hooks`` is idempotent); then
every target is resolved again and must be the hook's wrapper, and the request record's fields must be routed:
anything else stops the process at start (``HookError``), never a half-instrumented engine.

| what | SGLang target | hook |
|---|---|---|
| build | ``KVCacheConfigurator.configure`` | after: the allocator in its result is wrapped |
| attach | ``kv_cache_builder.build_kv_cache`` | after: the scheduler's tree cache, request rows, window, exporters |
| extend | ``allocation.alloc_for_extend`` | around: the batch's requests bound, their protected prefixes given |
| decode | ``allocation.alloc_for_decode`` | around: bound (deferred ledger: the batch's records verified after) |
| speculative | ``allocation.alloc_for_spec_decode`` | around: bound |
| PD decode prealloc | ``decode.alloc_for_decode_prealloc`` and ``..._hisparse`` | around: bound |
| release | ``common.release_kv_cache``; ``DecodeKVCacheOffloadManager._release_finished_req`` | around: released |
| SWA evicted length | ``ReqKvInfo.set_evicted_seqlen`` | around: routed through the checked ledger |
| step | ``Scheduler.ingest_requests`` | before: one step per iteration that did work |
| idle sweep | ``Scheduler.on_idle`` | after: ``check_consistency()``, rate-limited |

Not through the registry (it hooks callables): ``ReqKvInfo``'s length fields (``kvrecord.py``; an immediate ledger
only) and the tree cache's ``checkpoint``, wrapped on the scheduler's own tree instance at attach (its class varies
with the cache).
"""

from __future__ import annotations

import pkgutil

from instrumented_alloc.sglang_plugin import kvrecord, session

ALLOCATION = "sglang.srt.mem_cache.allocation"
DECODE = "sglang.srt.disaggregation.decode"


class HookError(RuntimeError):
    """A hook did not take: the message names it."""


# -- the hooks ------------------------------------------------------------------------------------------------------
def _after_configure(result, configurator, *args, **kwargs):
    sess = session.current()
    alloc = result.token_to_kv_pool_allocator
    if sess is None or alloc is None:
        return None
    window = None
    if getattr(alloc, "swa_attn_allocator", None) is not None:
        window = getattr(configurator.model_config, "sliding_window_size", None)
    wrapped = sess.wrap(alloc, sliding_window=window)
    if wrapped is alloc:
        return None
    import msgspec

    return msgspec.structs.replace(result, token_to_kv_pool_allocator=wrapped)


def _after_build(result, *args, **kwargs):
    sess = session.current()
    if sess is None or not sess.owns(result.token_to_kv_pool_allocator):
        return None
    from instrumented_alloc.sglang_plugin import attach

    attach.attach(sess, result, kwargs.get("server_args"), kwargs.get("model_config"))
    return None


def _bound(sess, reqs, call, lens=None, *, fresh: bool = True):
    """``call()`` with the allocator bound to ``reqs`` (in batch order), unless another hook already bound it.
    ``fresh`` (an extend, a preallocation): the requests' records are named (``Session.bind_records``) and each
    request's protected prefix given to the wrapper first (``Session.protect``). Deferred ledger: the batch's
    records are verified after the call (``Session.verify``), SGLang's writes in it included."""
    alloc = sess.alloc
    if alloc.bound_rids is not None:
        return call()
    cost = alloc.cost
    cost.start()
    try:
        rids = sess.bind_records(reqs, fresh=fresh)
        with alloc.batch(rids, lens=lens):
            if fresh:
                sess.protect(reqs)
            slots = alloc.bound_slots
            cost.stop_hooks()
            try:
                out = call()
            finally:
                cost.start()
        if sess.deferred:
            cost.stop_hooks()
            sess.verify(reqs, slots, protected=fresh)
        sess.active = True
    finally:
        cost.end_hooks()
    return out


def _around_extend(original, batch, *args, **kwargs):
    sess = session.current()
    if sess is None or not sess.owns(batch.tree_cache.token_to_kv_pool_allocator):
        return original(batch, *args, **kwargs)
    # Page size 1 allocates with alloc(extend_num_tokens): each request's share is its extend length.
    lens = [int(x) for x in batch.extend_lens] if sess.alloc.page_size == 1 else None
    return _bound(sess, list(batch.reqs), lambda: original(batch, *args, **kwargs), lens)


def _around_decode(original, batch, token_per_req, *args, **kwargs):
    sess = session.current()
    if sess is None or not sess.owns(batch.tree_cache.token_to_kv_pool_allocator):
        return original(batch, token_per_req, *args, **kwargs)
    reqs = list(batch.reqs)
    lens = [int(token_per_req)] * len(reqs) if sess.alloc.page_size == 1 and token_per_req != 1 else None
    return _bound(sess, reqs, lambda: original(batch, token_per_req, *args, **kwargs), lens, fresh=False)


def _around_spec(original, tree_cache, req_to_token_pool, *args, **kwargs):
    sess = session.current()
    if sess is None or not sess.owns(tree_cache.token_to_kv_pool_allocator):
        return original(tree_cache, req_to_token_pool, *args, **kwargs)
    reqs = list(kwargs["reqs"])
    lens = None
    if sess.alloc.page_size == 1:
        nxt, cur = kwargs["nxt_kv_lens_cpu"].tolist(), kwargs["cur_kv_lens_cpu"].tolist()
        lens = [int(a) - int(b) for a, b in zip(nxt, cur)]
    return _bound(sess, reqs, lambda: original(tree_cache, req_to_token_pool, *args, **kwargs), lens, fresh=False)


def _around_prealloc(original, allocator, *args, **kwargs):
    sess = session.current()
    if sess is None or not sess.owns(allocator):
        return original(allocator, *args, **kwargs)
    req = kwargs["req"]
    return _bound(sess, [req], lambda: original(allocator, *args, **kwargs))


def _around_release(original, req, *args, **kwargs):
    sess = session.current()
    if sess is None or sess.alloc is None:
        return original(req, *args, **kwargs)
    return sess.release(req, original, *args, **kwargs)


def _around_offload_release(original, manager, req, *args, **kwargs):
    sess = session.current()
    if sess is None or sess.alloc is None:
        return original(manager, req, *args, **kwargs)
    return sess.release(req, lambda r, *a, **k: original(manager, r, *a, **k), *args, **kwargs)


def _around_set_evicted(original, kv, component_type, length, *args, **kwargs):
    sess = session.current()
    if sess is not None and sess.alloc is not None and getattr(component_type, "name", None) == "SWA":
        sess.routed_write(kv, "swa_evicted_seqlen", length)
    return original(kv, component_type, length, *args, **kwargs)


def _before_ingest(scheduler, *args, **kwargs):
    sess = session.current()
    if sess is not None and sess.active:
        sess.step()


def _after_idle(result, scheduler, *args, **kwargs):
    sess = session.current()
    if sess is not None and sess.dirty_since_sweep and sess.alloc is not None:
        sess.idle(scheduler)


# -- registration ---------------------------------------------------------------------------------------------------
def hook_table():
    """(target, hook type name, hook) for every registry hook."""
    return (
        ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure", "AFTER", _after_configure),
        ("sglang.srt.mem_cache.kv_cache_builder.build_kv_cache", "AFTER", _after_build),
        (f"{ALLOCATION}.alloc_for_extend", "AROUND", _around_extend),
        (f"{ALLOCATION}.alloc_for_decode", "AROUND", _around_decode),
        (f"{ALLOCATION}.alloc_for_spec_decode", "AROUND", _around_spec),
        (f"{DECODE}.alloc_for_decode_prealloc", "AROUND", _around_prealloc),
        (f"{DECODE}.alloc_for_decode_prealloc_hisparse", "AROUND", _around_prealloc),
        ("sglang.srt.mem_cache.common.release_kv_cache", "AROUND", _around_release),
        (
            "sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager._release_finished_req",
            "AROUND",
            _around_offload_release,
        ),
        ("sglang.srt.managers.schedule_batch.ReqKvInfo.set_evicted_seqlen", "AROUND", _around_set_evicted),
        ("sglang.srt.managers.scheduler.Scheduler.ingest_requests", "BEFORE", _before_ingest),
        ("sglang.srt.managers.scheduler.Scheduler.on_idle", "AFTER", _after_idle),
    )


def _resolve(target: str):
    owner, _, name = target.rpartition(".")
    obj = pkgutil.resolve_name(owner)
    return obj, name, getattr(obj, name)


def _wraps(fn, original) -> bool:
    """Whether ``fn`` is a wrapper chain (``__wrapped__`` links, as SGLang's hooks set) that reaches ``original``."""
    seen = 0
    while fn is not original and seen < 32:
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
        seen += 1
    return fn is original


def install(extra=(), *, route: bool = True) -> None:
    """Register every hook (and ``extra``: more (target, type, hook)), apply them, and verify that each took;
    ``route``: route the request record's fields (an immediate ledger, see ``Session``)."""
    apply((*hook_table(), *extra))
    if not route:
        return
    from sglang.srt.managers.schedule_batch import ReqKvInfo

    kvrecord.route(ReqKvInfo)
    if not kvrecord.routed(ReqKvInfo):
        raise HookError("instrumented-alloc: ReqKvInfo's length fields could not be routed through the ledger")


def apply(table) -> None:
    """Register the hooks of ``table`` ((target, type name, hook) each) with SGLang's registry, apply them at once
    (the registry applies a target once: every hook of a target must be registered before), and verify that each
    target is now a wrapper chain reaching its original (``HookError`` naming those that are not)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    originals = {}
    for target, kind, hook in table:
        try:
            originals[target] = _resolve(target)[2]
        except (ImportError, AttributeError, ValueError) as exc:
            raise HookError(f"instrumented-alloc: hook target {target} is not in this SGLang: {exc}") from exc
        HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    missing = []
    for target, _kind, _hook in table:
        obj, name, now = _resolve(target)
        raw = obj.__dict__.get(name, now) if isinstance(obj, type) else now
        raw = getattr(raw, "__func__", raw)  # a classmethod or staticmethod keeps its wrapper inside
        if raw is originals[target] or not _wraps(raw, getattr(originals[target], "__func__", originals[target])):
            missing.append(target)
    if missing:
        raise HookError(
            "instrumented-alloc: these SGLang hooks did not apply (see SGLang's 'Failed to apply hooks' log "
            f"above): {', '.join(dict.fromkeys(missing))}"
        )
