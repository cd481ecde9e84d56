"""Stateful property tests: a hypothesis ``RuleBasedStateMachine`` per allocator config, wrapped and bare.

Every config of ``tests/test_wrapper_properties.py`` (token ps 1, paged ps 4 and 16, SWA ps 1, 4 and 16, HiSparse
ps 4, ours; the same token, paged and SWA configs on SGLang 0.5.23's own classes, ``*-sglang``), each with
``need_sort`` off and on: 26 machines. Each drives the wrapper (``mode="raise"``,
``verify="immediate"``) and a bare twin through that file's ``Engine`` (imported, not copied).

Valid rules (wrapper and bare twin, same calls): extend (new and existing requests), decode, PD prealloc (SWA tails
via ``alloc_for_decode_prealloc(swa_tail_len=...)`` for SWA ps > 1, ``alloc_logical_only`` for HiSparse), SWA
eviction (``free_swa_segment`` + the ledger write), rollback (``free_segment``), finish by plain frees (``free``, or
``free_swa_segment`` + ``free_full``), finish by segment frees (``free_segments``, ``free_full_segments`` for the
evicted part), free groups (``free_group_begin`` .. ``free_group_end`` spanning several rules; releases after
the end), need_sort merges, step boundaries, ``release_request``.

After every rule (``@invariant``): zero violations beyond the expected ones, the inner allocator's state equal to
the bare twin's (``allocator_state``: free lists, staging, SWA/HiSparse mappings), and a model derived from the
returned slots alone: the pages each live request holds (full pool: from its row; SWA pool: ceil(seq / ps) -
evicted / ps pages, named through the bare twin's mapping), the ledger values, and the free page count of each pool
(capacity - held - held by an open free group) against the inner pool's ``available_size``; and every request
slot's page count in the ledger equal to the census of the wrapper's page owners.
The step rule and the teardown also compare the page owners replayed from the events with the wrapper's; the
teardown frees everything and requires a clean ``check_consistency()`` and every page free.

Invalid rules run against the wrapper only, never the bare twin: each must raise ``InvariantViolation`` with exactly
the right id, record exactly one violation, and leave the inner allocator equal to the bare twin, so the machine
goes on: double free of a finished row, free of a never-allocated page, an unaligned ``free_segment`` start, an
unaligned / decreasing / inside-the-window ``swa_evicted_seqlen``, ``kv_allocated_len`` off a page,
``kv_committed_len > kv_allocated_len``, and releasing a request that still holds pages (``request_leak``; its
pages are then freed, and the sweep at teardown must be clean).

Examples: each machine runs ``max(4, P // 3)`` examples of up to 50 steps (``stateful_step_count``), P being the
hypothesis profile's ``max_examples`` (tests/conftest.py): dev (60) -> 20 examples per machine, 520 in all; ci
(150, ``CI=true``) -> 50 per machine, 1,300 examples in all (about 55,000 rules, each followed by the checks
above; about 25 s on a 2-core machine with another job on the other core). ``RUN_STATS`` counts runs, checks and
the invalid rules that fired, per machine.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from instrumented_alloc import InvariantViolation
from tests.engine_model import Req, allocator_state, t
from tests.test_wrapper_properties import CONFIGS, Engine

STEPS = 50
# Rules and runs executed per machine (for the figures in the docstring; read by nothing else).
RUN_STATS: dict[str, Counter] = {}
EXAMPLES = max(4, settings.default.max_examples // 3)


def _pages(row, ps: int) -> set[int]:
    return {s // ps for s in row}


class AllocatorMachine(RuleBasedStateMachine):
    """One allocator config; subclasses set ``config`` and ``need_sort``."""

    config = "paged-4"
    need_sort = False

    reqs = Bundle("reqs")
    finished = Bundle("finished")

    def __init__(self):
        super().__init__()
        self.e = Engine(self.config, self.need_sort, "immediate", mode="raise")
        self.ps = self.e.ps
        self.kind = self.e.kind
        self.expected = 0  # violations the invalid rules provoked
        self.group_open = False
        self.pending = {"full": 0, "swa": 0}  # pages held by the open free group
        self.to_release: list[str] = []
        self.ever: set[int] = set()  # full-pool pages handed out since clear()
        inner = self.e.inner
        self.pool_alloc = {
            "full": getattr(inner, "full_attn_allocator", None)
            or getattr(inner, "logical_attn_allocator", None)
            or inner
        }
        if self.kind == "swa":
            self.pool_alloc["swa"] = inner.swa_attn_allocator
        self.num_pages = {n: s.num_pages for n, s in self.e.w.snapshot().items()}
        self.stats = RUN_STATS.setdefault(f"{self.config}/{'need_sort' if self.need_sort else 'plain'}", Counter())
        self.stats["runs"] += 1

    # -- model -----------------------------------------------------------------------------------------------
    def live(self) -> list[Req]:
        return list(self.e.reqs.values())

    def swa_pages_of(self, r: Req) -> int:
        return 0 if not r.row else -(-r.seq // self.ps) - r.evicted // self.ps

    def held(self) -> dict[str, int]:
        out = {"full": sum(len(_pages(r.row, self.ps)) for r in self.live())}
        if self.kind == "swa":
            out["swa"] = sum(self.swa_pages_of(r) for r in self.live())
        return out

    def freeing(self, fn) -> None:
        """Run a valid free rule; inside an open group the pages it frees are held until the end."""
        before = self.held()
        fn()
        if self.group_open and self.kind != "hisparse":
            after = self.held()
            for pool in before:
                self.pending[pool] += before[pool] - after[pool]

    def expect(self, inv: str, action) -> None:
        """An invalid step against the wrapper: exactly ``inv``, once, and the inner allocator untouched."""
        w = self.e.w
        counts = dict(w.violation_counts)
        state = allocator_state(self.e.inner)
        with pytest.raises(InvariantViolation) as info:
            action()
        assert info.value.invariant == inv, str(info.value)
        diff = {k: v - counts.get(k, 0) for k, v in w.violation_counts.items() if v != counts.get(k, 0)}
        assert diff == {inv: 1}, [str(v) for v in list(w.violations)[-3:]]
        assert w.violations[-1] is info.value.violation
        self.expected += 1
        self.stats[inv] += 1
        assert allocator_state(self.e.inner) == state

    # -- valid rules ---------------------------------------------------------------------------------------------
    @initialize()
    def start(self):
        pass

    @precondition(lambda self: not self.group_open)
    @rule(target=reqs, lens=st.lists(st.integers(1, 50), min_size=1, max_size=3))
    def extend_new(self, lens):
        lens = [1 + x % (3 * self.ps + 3) for x in lens]
        new = [Req(self.e.new_rid()) for _ in lens]
        self.e.extend(new, lens)
        return multiple(*[r for r in new if r.rid in self.e.reqs])

    @precondition(lambda self: not self.group_open)
    @rule(r=reqs, n=st.integers(1, 80))
    def extend_more(self, r, n):
        if r.rid in self.e.reqs:
            self.e.extend([r], [1 + n % (4 * self.ps + 2)])

    @precondition(lambda self: not self.group_open)
    @rule(r1=reqs, r2=reqs)
    def decode(self, r1, r2):
        batch = [r for r in {r1.rid: r1, r2.rid: r2}.values() if r.rid in self.e.reqs and r.row]
        if batch:
            self.e.decode(batch)

    @rule(r=reqs, pages_back=st.integers(1, 2))
    def rollback(self, r, pages_back):
        if r.rid in self.e.reqs and r.row:
            self.freeing(lambda: self.e.rollback(r, pages_back))

    def _release(self, r: Req) -> None:
        if self.group_open:
            self.to_release.append(r.rid)
        else:
            self.e.w.release_request(r.rid)

    @rule(target=finished, r=consumes(reqs), plain=st.booleans())
    def finish(self, r, plain):
        row = list(r.row)
        self.freeing(lambda: self.e.finish(r, plain))
        self._release(r)
        return row

    @rule(target=finished, r=consumes(reqs), cut=st.integers(0, 20))
    def finish_segments(self, r, cut):
        e, ps, row = self.e, self.ps, list(r.row)
        lo = r.evicted if self.kind == "swa" else 0
        c = min(lo + cut * ps, (r.seq + ps - 1) // ps * ps)

        def free():
            if lo:
                e.both("free_full_segments", [(t(row[:lo]), 0)])
            e.both("free_segments", [(t(row[lo:c]), lo), (t(row[c:]), c)])
            del e.reqs[r.rid]

        self.freeing(free)
        self._release(r)
        return row

    @precondition(lambda self: not self.group_open)
    @rule()
    def group_begin(self):
        self.e.both("free_group_begin")
        self.group_open = True

    @precondition(lambda self: self.group_open)
    @rule()
    def group_end(self):
        self.e.both("free_group_end")
        self.group_open = False
        self.pending = {"full": 0, "swa": 0}
        for rid in self.to_release:
            self.e.w.release_request(rid)
        self.to_release = []

    @rule()
    def step(self):
        self.e.w.step()
        self.e.check_replay()

    # -- invalid rules (wrapper only) ----------------------------------------------------------------------------
    @precondition(lambda self: not self.group_open)
    @rule(row=finished)
    def bad_double_free(self, row):
        ps = self.ps
        pages = _pages(row, ps)
        if not row or pages & set().union(*(_pages(r.row, ps) for r in self.live())):
            return  # some page was handed out again: freeing it is not a double free
        op = "free_full" if self.kind == "swa" else "free"
        self.expect("double_free", lambda: getattr(self.e.w, op)(t(row)))

    @precondition(lambda self: not self.group_open)
    @rule(k=st.integers(0, 10**6))
    def bad_free_unallocated(self, k):
        never = sorted(set(range(1, self.num_pages["full"] + 1)) - self.ever)
        if not never:
            return
        page = never[k % len(never)]
        w = self.e.w
        if self.kind in ("token", "paged"):
            self.expect("free_unallocated", lambda: w.free_page_ids(t([page])))
        elif self.kind == "swa":
            self.expect("free_unallocated", lambda: w.free_full(t([page * self.ps])))
        else:
            self.expect("free_unallocated", lambda: w.free(t([page * self.ps])))

    def _window_room(self, r: Req) -> int:
        return max(0, r.seq - self.e.window)

    @precondition(lambda self: not self.group_open)
    @rule(r=reqs)
    def bad_committed_gt_allocated(self, r):
        if r.rid not in self.e.reqs:
            return
        kv = self.e.w.ledger[r.rid]
        v = -(-r.seq // self.ps) * self.ps + 1
        self.expect("kv_committed_le_allocated", lambda: setattr(kv, "kv_committed_len", v))

    @precondition(lambda self: not self.group_open)
    @rule(target=finished, r=consumes(reqs))
    def bad_release_holding_pages(self, r):
        if not r.row:
            self.e.finish(r, plain=True)
            self.e.w.release_request(r.rid)
            return []
        row = list(r.row)
        self.expect("request_leak", lambda: self.e.w.release_request(r.rid))
        assert r.rid not in self.e.w.ledger  # released (and its slot marked leaked) before the raise
        # The engine then frees the pages it leaked: no further violation, the sweep is clean at teardown.
        self.e.finish(r, plain=True)
        return row

    # -- after every rule ------------------------------------------------------------------------------------
    @invariant()
    def same_as_bare_twin_and_model(self):
        e, ps = self.e, self.ps
        w = e.w
        self.stats["checks"] += 1
        assert sum(w.violation_counts.values()) == self.expected, [str(v) for v in w.violations]
        assert allocator_state(e.inner) == allocator_state(e.bare)
        live = self.live()
        for r in live:
            self.ever |= _pages(r.row, ps)
        snap = w.snapshot()
        # Pages each live request holds, per pool: the model's (from the returned slots) against the wrapper's.
        want_full = {r.rid: _pages(r.row, ps) for r in live if r.row}
        owner = snap["full"].owner
        got_full = {}
        for slot, rid in snap["full"].slot_rids.items():
            pages = set(np.flatnonzero(owner == slot).tolist())
            if pages:
                got_full[rid] = pages
        assert got_full == want_full
        if self.kind == "swa":
            mapping = e.bare.full_to_swa_index_mapping
            swa_owner = snap["swa"].owner
            for r in live:
                want = {int(mapping[s]) // ps for s in r.row[r.evicted :]}
                assert len(want) == self.swa_pages_of(r), r
                assert 0 not in want
                if want:
                    slot = w.ledger.slot_of(r.rid, create=False)
                    assert set(np.flatnonzero(swa_owner == slot).tolist()) == want, r
        # Every request slot's page count (what ledger_matches_pages compares) is the owner array's census, the
        # slots of released requests included (0), whatever the invalid rules did.
        for pool, counts in w.ledger.owned.items():
            codes = snap[pool].owner
            census = np.bincount(codes[codes >= 0], minlength=counts.size)
            assert counts.tolist() == census[: counts.size].tolist(), pool
        # Free pages per pool: capacity - held by live requests - held by an open free group.
        held = self.held()
        for pool, a in self.pool_alloc.items():
            want = self.num_pages[pool] - held[pool] - self.pending[pool]
            assert a.available_size() // ps == want, (pool, a.available_size() // ps, want)
        # The ledger of every live request, from the model.
        for r in live:
            kv = w.ledger[r.rid]
            assert (kv.kv_allocated_len, kv.kv_committed_len, kv.swa_evicted_seqlen) == (
                -(-r.seq // ps) * ps,
                r.seq,
                r.evicted,
            ), r

    def teardown(self):
        e = self.e
        if self.group_open:
            self.group_end()
        for r in self.live():
            e.finish(r, plain=True)
            e.w.release_request(r.rid)
        e.w.step()
        assert e.w.check_consistency() == []
        assert sum(e.w.violation_counts.values()) == self.expected
        assert allocator_state(e.inner) == allocator_state(e.bare)
        for pool, a in self.pool_alloc.items():
            assert a.available_size() // self.ps == self.num_pages[pool], pool
        e.check_replay()


reqs = Bundle("reqs")  # the same bundles as AllocatorMachine's (bundles are keyed by name)


class PagedRules:
    """Rules for page size > 1: PD prealloc (SWA tails on SWA), unaligned segment starts, allocated lengths off
    a page."""

    @precondition(lambda self: not self.group_open)
    @rule(target=reqs, fill=st.integers(1, 67))
    def prealloc(self, fill):
        fill = 1 + fill % (4 * self.ps + 3)
        n = len(self.e.reqs)
        self.e.prealloc(fill)
        return multiple(*self.live()[n:])

    @precondition(lambda self: not self.group_open)
    @rule(r=reqs, off=st.integers(1, 15))
    def bad_segment_start(self, r, off):
        lo = r.evicted if self.kind == "swa" else 0
        if r.rid not in self.e.reqs or r.seq <= lo + 1:
            return
        start = lo + 1 + off % (r.seq - lo - 1)
        if start % self.ps == 0:
            start -= 1 if start - 1 > lo else -1
        if start % self.ps == 0 or start >= r.seq:
            return
        self.expect("segment_start_unaligned", lambda: self.e.w.free_segment(t(r.row[start:]), start_pos=start))

    @precondition(lambda self: not self.group_open)
    @rule(r=reqs)
    def bad_allocated_off_page(self, r):
        if r.rid not in self.e.reqs:
            return
        kv = self.e.w.ledger[r.rid]
        v = -(-r.seq // self.ps) * self.ps + 1
        self.expect("kv_allocated_len_page_aligned", lambda: setattr(kv, "kv_allocated_len", v))


class SwaRules:
    """SWA only: eviction, and the SWA ledger rules."""

    @rule(r=reqs)
    def evict(self, r):
        if r.rid in self.e.reqs:
            self.freeing(lambda: self.e.evict(r))

    @precondition(lambda self: not self.group_open and self.ps > 1)
    @rule(r=reqs)
    def bad_evicted_unaligned(self, r):
        if r.rid not in self.e.reqs or not r.row or self._window_room(r) < r.evicted + 1:
            return
        kv = self.e.w.ledger[r.rid]
        self.expect("swa_evicted_seqlen_page_aligned", lambda: setattr(kv, "swa_evicted_seqlen", r.evicted + 1))

    @precondition(lambda self: not self.group_open)
    @rule(r=reqs)
    def bad_evict_inside_window(self, r):
        if r.rid not in self.e.reqs or not r.row:
            return
        ps = self.ps
        v = max(r.evicted + ps, (self._window_room(r) // ps + 1) * ps)
        if v > -(-r.seq // ps) * ps:
            return
        kv = self.e.w.ledger[r.rid]
        self.expect("swa_evicted_within_window", lambda: setattr(kv, "swa_evicted_seqlen", v))

    @precondition(lambda self: not self.group_open)
    @rule(r=reqs)
    def bad_evicted_decreases(self, r):
        if r.rid not in self.e.reqs or r.evicted < self.ps or r.evicted - self.ps > self._window_room(r):
            return
        kv = self.e.w.ledger[r.rid]
        self.expect("swa_evicted_seqlen_monotonic", lambda: setattr(kv, "swa_evicted_seqlen", r.evicted - self.ps))


class MergeRules:
    """need_sort on the Token and Paged classes (SGLang's SWA and HiSparse classes have no working merge)."""

    @precondition(lambda self: not self.group_open)
    @rule()
    def merge(self):
        self.e.both("merge_and_sort_free")


def _machine(config: str, need_sort: bool):
    name = f"Machine_{config.replace('-', '_')}_{'sorted' if need_sort else 'plain'}"
    kind, ps, *_ = config.split("-")  # "swa-4", or "swa-4-sglang": SGLang's own class
    mixins = [PagedRules] if int(ps) > 1 else []
    if kind == "swa":
        mixins.append(SwaRules)
    if need_sort and kind in ("token", "paged"):
        mixins.append(MergeRules)
    cls = type(name, (*mixins, AllocatorMachine), {"config": config, "need_sort": need_sort})
    case = cls.TestCase
    case.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None)
    return case


for _config in CONFIGS:
    for _need_sort in (False, True):
        _case = _machine(_config, _need_sort)
        globals()[f"Test_{_config.replace('-', '_')}_{'need_sort' if _need_sort else 'plain'}"] = _case
del _config, _need_sort, _case


def test_every_config_has_machines():
    names = {n for n in globals() if n.startswith("Test_")}
    assert len(names) == 2 * len(CONFIGS)


def test_invalid_rules_leave_a_working_allocator():
    """A fixed run of every invalid rule on SWA ps 4: the machine's own rule sequence, spelled out."""
    m = type("M", (PagedRules, SwaRules, AllocatorMachine), {"config": "swa-4", "need_sort": False})()
    reqs = m.extend_new([30, 10])  # two requests of 1 + 30 % 15 = 1 and 11 tokens
    reqs = list(reqs.values)
    for _ in range(3):
        m.extend_more(reqs[0], 8)  # + 1 + 8 % 18 = 9 tokens each: 28
    m.same_as_bare_twin_and_model()
    m.evict(reqs[0])
    assert reqs[0].evicted == 12  # (28 - window 13) floored to a page
    m.same_as_bare_twin_and_model()
    m.bad_evicted_unaligned(reqs[0])
    m.bad_evict_inside_window(reqs[0])
    m.bad_evicted_decreases(reqs[0])
    m.bad_allocated_off_page(reqs[0])
    m.bad_committed_gt_allocated(reqs[0])
    m.bad_segment_start(reqs[1], 0)
    m.bad_free_unallocated(0)
    row = m.finish(reqs[1], plain=True)
    m.bad_double_free(row)
    m.same_as_bare_twin_and_model()
    m.bad_release_holding_pages(reqs[0])
    m.same_as_bare_twin_and_model()
    assert m.expected == 9
    assert dict(m.e.w.violation_counts) == {
        "swa_evicted_seqlen_page_aligned": 1,
        "swa_evicted_within_window": 1,
        "swa_evicted_seqlen_monotonic": 1,
        "kv_allocated_len_page_aligned": 1,
        "kv_committed_le_allocated": 1,
        "segment_start_unaligned": 1,
        "free_unallocated": 1,
        "double_free": 1,
        "request_leak": 1,
    }
    m.teardown()
