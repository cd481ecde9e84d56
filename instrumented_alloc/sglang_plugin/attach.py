"""Attach a session to the scheduler SGLang just built: its request rows, its tree cache, its exporters (the
session's ``attach_sinks``, injected by the entry point).

Runs once per scheduler process, in ``build_kv_cache``'s after-hook, when the tree cache and the request pool
exist and before the first request. The tree cache's ``checkpoint`` is wrapped on that instance (its class varies
with the cache: unified radix, radix, LMCache...), so that what a request hands to the cache passes to it in the
wrapper (``Session.checkpoint``).
"""

from __future__ import annotations

import functools

_MARK = "_kvalloc_checkpoint"


def attach(sess, result, server_args, model_config) -> None:
    sess.req_to_token = result.req_to_token_pool.req_to_token
    window = result.sliding_window_size
    led = sess.alloc.ledger
    if window is not None and led.sliding_window is None and "swa" in led.pools:
        led.sliding_window = int(window)
    tree = result.tree_cache
    sess.tree = tree
    if tree is not None and not getattr(tree, _MARK, False):
        original = tree.checkpoint

        @functools.wraps(original)
        def checkpoint(req, *, up_to, **kwargs):
            return sess.checkpoint(original, req, up_to=up_to, **kwargs)

        tree.checkpoint = checkpoint
        setattr(tree, _MARK, True)
    if sess.attach_sinks is not None:
        sess.attach_sinks(sess, server_args, model_config)
