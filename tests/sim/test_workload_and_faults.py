"""Workload generation, trace parsing and fault planning: exact values and exact error lines."""

from __future__ import annotations

import itertools
import statistics

import pytest

from instrumented_alloc.sim import PRESETS, FaultError, TraceError, parse_trace, plan, synthetic
from instrumented_alloc.sim.faults import parse_injection


def test_synthetic_is_seeded_heavy_tailed_and_clipped():
    p = PRESETS["dense"]
    a = list(itertools.islice(synthetic(p, 1), 3000))
    b = list(itertools.islice(synthetic(p, 1), 3000))
    c = list(itertools.islice(synthetic(p, 2), 3000))
    assert a == b and a != c
    assert [r.rid for r in a[:3]] == ["r0", "r1", "r2"]
    assert all(x.arrival < y.arrival for x, y in itertools.pairwise(a))
    # Poisson arrivals at the preset's rate: 3000 arrivals take about 3000 / rate steps.
    assert abs(a[-1].arrival * p.rate / 3000 - 1) < 0.1
    prompts = [r.prompt_len for r in a]
    assert abs(statistics.median(prompts) / p.prompt_median - 1) < 0.15
    assert max(prompts) == p.prompt_max  # the tail reaches the clip
    assert statistics.mean(prompts) > statistics.median(prompts)  # skewed right
    assert min(r.output_len for r in a) >= 1 and max(r.output_len for r in a) <= p.output_max


def test_parse_trace_reads_requests_in_order():
    reqs = parse_trace(['{"arrival": 0, "prompt_len": 5, "output_len": 2}', "",
                        '{"arrival": 2.5, "prompt_len": 7, "output_len": 1}'], "t.jsonl")
    assert [(r.rid, r.arrival, r.prompt_len, r.output_len) for r in reqs] == [("t0", 0.0, 5, 2), ("t1", 2.5, 7, 1)]


@pytest.mark.parametrize(
    ("line", "msg"),
    [
        ("{nope", "t.jsonl:2: not JSON"),
        ("[1, 2]", "t.jsonl:2: expected an object"),
        ('{"arrival": 1, "prompt_len": 5}', "t.jsonl:2: missing output_len"),
        ('{"arrival": "soon", "prompt_len": 5, "output_len": 1}', "t.jsonl:2: arrival must be a number"),
        ('{"arrival": -1, "prompt_len": 5, "output_len": 1}', "t.jsonl:2: arrival must be >= 0 steps, got -1"),
        ('{"arrival": 1, "prompt_len": 0, "output_len": 1}', "t.jsonl:2: prompt_len must be an integer >= 1"),
        ('{"arrival": 1, "prompt_len": 5, "output_len": 1.5}', "t.jsonl:2: output_len must be an integer >= 1"),
    ],
)
def test_parse_trace_names_the_bad_line(line, msg):
    with pytest.raises(TraceError) as info:
        parse_trace(['{"arrival": 0, "prompt_len": 5, "output_len": 2}', line], "t.jsonl")
    assert str(info.value).startswith(msg)


def test_parse_trace_refuses_time_going_back_and_requests_larger_than_the_pool():
    lines = ['{"arrival": 3, "prompt_len": 5, "output_len": 2}', '{"arrival": 2, "prompt_len": 5, "output_len": 2}']
    with pytest.raises(TraceError, match=r"^t\.jsonl:2: arrival 2 is earlier than the line before \(3\.0\)$"):
        parse_trace(lines, "t.jsonl")
    fits = '{"arrival": 0, "prompt_len": 60, "output_len": 4}'  # exactly the pool
    assert len(parse_trace([fits], "t.jsonl", max_tokens=64)) == 1
    with pytest.raises(TraceError) as info:
        parse_trace([fits, '{"arrival": 1, "prompt_len": 60, "output_len": 5}'], "t.jsonl", max_tokens=64)
    assert str(info.value) == (
        "t.jsonl:2: prompt_len + output_len = 65 tokens is more than the KV pool holds (64 tokens): "
        "the request could never finish"
    )


def test_an_empty_trace_is_an_error():
    with pytest.raises(TraceError, match=r"t\.jsonl: no requests"):
        parse_trace(["", "  "], "t.jsonl")


def test_injection_parsing_and_planning():
    assert parse_injection("leak") == ("leak", None)
    assert parse_injection("leak@0") == ("leak", 0)
    with pytest.raises(FaultError, match="unknown fault 'oops'"):
        parse_injection("oops@3")
    with pytest.raises(FaultError, match="must be >= 0"):
        parse_injection("leak@-1")
    swa = PRESETS["swa-128"]
    inj = plan(["double-free@7", "leak"], swa, seed=1, steps=100)
    assert next((i.fault.name, i.step, i.explicit) for i in inj) == ("double-free", 7, True)
    assert not inj[1].explicit and 1 <= inj[1].step <= 50
    assert inj[1].step == plan(["double-free@7", "leak"], swa, seed=1, steps=100)[1].step
    unbounded = plan(["leak"], swa, seed=1, steps=None)[0]
    assert 200 <= unbounded.step <= 600
    with pytest.raises(FaultError, match="outside the run"):
        plan(["leak@100"], swa, seed=1, steps=100)
    with pytest.raises(FaultError, match="needs an SWA preset"):
        plan(["swa-inside-window"], PRESETS["dense"], seed=1, steps=None)
    with pytest.raises(FaultError, match="page size > 1"):
        plan(["swa-misaligned"], swa.with_page_size(1), seed=1, steps=None)
