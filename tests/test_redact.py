"""instrumented_alloc.redact: keyed pseudonyms for request ids, and the redaction of violations, events and
snapshots. Expected pseudonyms are computed here independently with hmac."""

from __future__ import annotations

import hashlib
import hmac
import threading

import numpy as np
import pytest
import torch

from instrumented_alloc import InstrumentedAllocator, Violation
from instrumented_alloc import events as ev
from instrumented_alloc.allocators import PagedTokenToKVPoolAllocator
from instrumented_alloc.redact import RequestIdHasher, as_hasher
from instrumented_alloc.replay import apply, initial_state

KEY = b"test-key"


def expected(text: str, key: bytes = KEY, digits: int = 16) -> str:
    return "h:" + hmac.new(key, text.encode(), hashlib.sha256).hexdigest()[:digits]


def test_known_values():
    h = RequestIdHasher(KEY)
    assert h("req-1") == expected("req-1")
    assert h("req-1").startswith("h:") and len(h("req-1")) == 18
    assert h(7) == expected("7") == h("7")  # an int is its decimal text
    assert h(np.int64(7)) == expected("7")
    assert h(-12) == expected("-12")
    assert h(True) == expected("True")  # a bool is not an int here (nor the cached entry of 1)
    assert h(1) == expected("1")
    assert h(("a", 1)) == expected("('a', 1)")  # anything else: its repr
    assert h("é") == expected("é")
    assert h(None) is None
    assert RequestIdHasher("test-key")("req-1") == expected("req-1")  # a str key is its UTF-8 bytes
    assert RequestIdHasher(KEY, digits=32)("req-1") == expected("req-1", digits=32)
    assert RequestIdHasher(b"other")("req-1") == expected("req-1", key=b"other") != h("req-1")


def test_deterministic_and_cached():
    h = RequestIdHasher(KEY, cache_size=4)
    first = [h(f"r{i}") for i in range(10)]
    assert len(h._cache) == 4  # bounded: the oldest went first
    assert list(h._cache) == ["r6", "r7", "r8", "r9"]
    assert [h(f"r{i}") for i in range(10)] == first == [expected(f"r{i}") for i in range(10)]
    assert RequestIdHasher(KEY)("r3") == first[3]  # another hasher with the same key agrees


def test_cache_is_thread_safe():
    h = RequestIdHasher(KEY, cache_size=50)
    errors: list = []

    def work(k):
        try:
            for i in range(2000):
                rid = f"t{k}.{i % 300}"
                assert h(rid) == expected(rid)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(h._cache) <= 50


def test_random_keys_differ_and_key_is_never_shown():
    a, b = RequestIdHasher.random(), RequestIdHasher.random()
    assert a("x") != b("x") and a("x") == a("x")
    assert repr(a) == "RequestIdHasher(hmac-sha256, 16 hex digits)"
    assert a.scheme == {
        "scheme": "hmac-sha256",
        "prefix": "h:",
        "hex_digits": 16,
        "text": "str; int as decimal; else repr",
    }
    assert KEY.decode() not in repr(RequestIdHasher(KEY)) + str(RequestIdHasher(KEY).scheme)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"key": b""}, ValueError),
        ({"key": ""}, ValueError),
        ({"key": 5}, TypeError),
        ({"key": KEY, "digits": 4}, ValueError),
        ({"key": KEY, "digits": 65}, ValueError),
        ({"key": KEY, "cache_size": 0}, ValueError),
    ],
)
def test_bad_arguments(kwargs, exc):
    with pytest.raises(exc):
        RequestIdHasher(**kwargs)


def test_as_hasher():
    h = RequestIdHasher(KEY)
    assert as_hasher(None) is None and as_hasher(False) is None
    assert as_hasher(h) is h
    assert as_hasher(KEY)("a") == as_hasher("test-key")("a") == expected("a")
    assert isinstance(as_hasher(True), RequestIdHasher) and as_hasher(True)("a") != expected("a")
    with pytest.raises(TypeError):
        as_hasher(3)


# -- violations ----------------------------------------------------------------------------------------------------
def test_violation_rid_and_message_redacted_and_nothing_else():
    h = RequestIdHasher(KEY)
    v = Violation(
        invariant="request_leak",
        message="request 'req-16' released while still owning 16 pages (full: 16)",
        pool="full",
        rid="req-16",
        step=16,
        op="release",
        ts=1.5,
        trace_id="ab" * 16,
    )
    r = h.violation(v)
    p = expected("req-16")
    assert r == Violation(
        invariant="request_leak",
        message=f"request '{p}' released while still owning 16 pages (full: 16)",
        pool="full",
        rid=p,
        step=16,
        op="release",
        ts=1.5,
        trace_id="ab" * 16,
    )


def test_violation_int_rid_only_that_form_is_replaced():
    h = RequestIdHasher(KEY)
    msg = "request 16: kv_allocated_len=16 means 4 full pages, it owns 16; page_size=16, request slot 16"
    r = h.violation(Violation("ledger_matches_pages", msg, pool="full", rid=16))
    p = expected("16")
    assert r.rid == p
    assert r.message == (
        f"request '{p}': kv_allocated_len=16 means 4 full pages, it owns 16; page_size=16, request slot 16"
    )
    # "request 1" is not a prefix match of "request 16".
    assert h.message(msg, 1) == msg


def test_violation_without_rid_unchanged():
    h = RequestIdHasher(KEY)
    v = Violation("double_free", "free frees [3] (1 pages) that are not in use (page 3 is free)", pool="full")
    assert h.violation(v) is v


def test_every_message_the_wrapper_writes_with_a_rid_is_redacted():
    """The three messages the wrapper writes that name a request id, from a real wrapper: a leak at release, a
    ledger that does not match the pages, and an unknown id given to release_request."""
    h = RequestIdHasher(KEY)
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
    with w.batch(["leaky"]):
        w.alloc(8)
    w.ledger["leaky"].kv_allocated_len = 8
    w.ledger.get_or_create("drift")
    with w.batch(["drift"]):
        w.alloc(4)
    w.ledger["drift"].kv_allocated_len = 8  # 2 pages by the ledger, 1 owned
    w.step()
    w.release_request("leaky")
    with pytest.raises(ValueError):
        w.release_request(404)
    got = [(v.invariant, v.rid) for v in w.violations]
    assert got == [("ledger_matches_pages", "drift"), ("request_leak", "leaky"), ("invalid_argument", 404)]
    red = [h.violation(v) for v in w.violations]
    assert [v.message for v in red] == [
        f"request {expected('drift')!r}: kv_allocated_len=8 means 2 full pages, it owns 1",
        f"request {expected('leaky')!r} released while still owning 2 pages, neither freed nor handed to the prefix "
        "cache (full: [1, 2] (2 pages))",
        f"release_request: rid: unknown request id {expected('404')!r}",
    ]
    for raw, r in zip(w.violations, red):
        assert r == Violation(**{**raw.__dict__, "rid": h(raw.rid), "message": r.message})


# -- events and snapshots ------------------------------------------------------------------------------------------
def test_event_fields():
    h = RequestIdHasher(KEY)
    rids = ("a", 2)
    alloc = ev.Alloc(seq=1, ts=0.0, step=3, op="alloc_extend", pool="full", n_slots=8, n_pages=2, rids=rids)
    d = h.event_fields(alloc.__dict__)
    assert d == {**alloc.__dict__, "rids": (expected("a"), expected("2"))}
    assert h.event_fields(alloc.__dict__)["rids"] is d["rids"]  # the same tuple object is mapped once
    assert alloc.rids == ("a", 2)  # the event is untouched
    w = ev.LedgerWrite(seq=2, ts=0.0, step=3, rid="a", field="kv_allocated_len", old=0, new=8)
    assert h.event_fields(w.__dict__) == {**w.__dict__, "rid": expected("a")}
    none = ev.RequestReleased(seq=3, ts=0.0, step=3, rid=None, pages_held=0)
    assert h.event_fields(none.__dict__) == none.__dict__
    sb = ev.StepBoundary(seq=4, ts=0.0, step=3, available={"full": 5})
    assert h.event_fields(sb.__dict__) is sb.__dict__
    # A Snapshot's rids are (slot, rid) pairs, as the wrapper emits them: the rid is redacted, the slot kept.
    snap = ev.Snapshot(
        seq=5,
        ts=0.0,
        step=3,
        pool="full",
        page_size=4,
        num_pages=8,
        owner=b"",
        rids=((0, "a"), (3, 2)),
        ledger=(("a", 8, 8, 0), (2, 4, 4, 0)),
    )
    assert h.event_fields(snap.__dict__) == {
        **snap.__dict__,
        "rids": ((0, expected("a")), (3, expected("2"))),
        "ledger": ((expected("a"), 8, 8, 0), (expected("2"), 4, 4, 0)),
    }
    v = Violation("request_leak", "request 'a' released while still owning 1 pages (full: 1)", rid="a")
    ve = ev.ViolationEvent(seq=6, ts=0.0, step=3, violation=v)
    assert h.event_fields(ve.__dict__) == {**ve.__dict__, "violation": h.violation(v)}


def test_event_fields_of_a_wrapper_snapshot_replays():
    """The wrapper's own Snapshot event, redacted, replays: each slot named by the pseudonym of its request."""
    h = RequestIdHasher(KEY)
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record", snapshot_every=1)
    seen: list = []
    w.subscribe(seen.extend)
    with w.batch(["a", 5], lens=[4, 4]):
        w.alloc(8)
    w.step()
    (snap,) = [e for e in seen if isinstance(e, ev.Snapshot)]
    assert snap.rids == ((0, "a"), (1, 5))
    red = ev.Snapshot(**h.event_fields(snap.__dict__))
    assert red.rids == ((0, expected("a")), (1, expected("5")))
    assert red.ledger == ((expected("a"), 4, 4, 0), (expected("5"), 4, 4, 0))
    st = apply(initial_state({"full": 16}), [red])
    assert st.slot_rids == {0: expected("a"), 1: expected("5")}
    assert st.ledger == {expected("a"): (4, 4, 0), expected("5"): (4, 4, 0)}
    assert st.owners["full"].tobytes() == snap.owner


def test_snapshots():
    h = RequestIdHasher(KEY)
    w = InstrumentedAllocator(PagedTokenToKVPoolAllocator(64, 4, torch.float16, "cpu"), mode="record")
    with w.batch(["a", 5], lens=[4, 4]):
        w.alloc(8)
    snaps = w.snapshot()
    red = h.snapshots(snaps)
    assert list(red) == list(snaps) == ["full"]
    s, r = snaps["full"], red["full"]
    assert r.ledger.rids == (expected("a"), expected("5")) and s.ledger.rids == ("a", 5)
    assert r.slot_rids == {slot: h(rid) for slot, rid in s.slot_rids.items()} and set(s.slot_rids.values()) == {"a", 5}
    assert np.array_equal(r.owner, s.owner) and np.array_equal(r.ledger.allocated, s.ledger.allocated)
    assert (r.pool, r.page_size, r.num_pages, r.step) == (s.pool, s.page_size, s.num_pages, s.step)
