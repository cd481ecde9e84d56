"""The page map (``dashboard.pagemap``), on its own: states, colours, counts, layout and the downsampling rule."""

from __future__ import annotations

import numpy as np
import pytest

from dashboard.pagemap import BACKGROUND, COLORS, MAX_CELLS, STATES, classify, layout, page_map, runs_of
from instrumented_alloc.replay import initial_owner
from instrumented_alloc.shadow import FREE, HELD_IDS, HELD_SET, PRISTINE, RESERVED, STAGED, USED_UNOWNED

IX = {k: i for i, k in enumerate(STATES)}


def test_every_owner_code_has_its_state():
    owner = np.array([RESERVED, PRISTINE, FREE, STAGED, HELD_SET, HELD_IDS, USED_UNOWNED, 0, 5, 5], np.int32)
    got = classify(owner)
    assert [STATES[i] for i in got] == [
        "reserved", "free", "free", "staged", "staged", "staged", "used", "used", "used", "used",
    ]  # fmt: skip


def test_violation_and_swa_evicted_override_the_code_state():
    owner = np.array([RESERVED, 3, 3, 4, FREE, FREE, PRISTINE, 4], np.int32)
    got = classify(owner, violation_slots={3}, swa_evicted=[4, 7, 99])
    # slot 3's pages are in a violation; page 4 (free) is SWA-evicted; page 7 was handed out again (slot 4): used;
    # page 99 is outside the pool and ignored.
    assert [STATES[i] for i in got] == ["reserved", "violation", "violation", "used", "swa_evicted", "free", "free",
                                        "used"]  # fmt: skip
    assert owner.tolist() == [RESERVED, 3, 3, 4, FREE, FREE, PRISTINE, 4]  # not mutated


def test_small_pool_one_cell_per_page_with_exact_pixels():
    owner = initial_owner(9)  # pages 0..9
    owner[[2, 3]] = 0
    owner[5] = STAGED
    pm = page_map(owner, violation_slots=[0])
    assert pm.pages_per_cell == 1 and pm.columns == 10 and pm.scale == 24
    assert pm.image.shape == (24, 240, 3) and pm.image.dtype == np.uint8
    assert pm.counts == {"free": 6, "used": 0, "staged": 1, "swa_evicted": 0, "reserved": 1, "violation": 2}
    assert sum(pm.counts.values()) == owner.size
    names = ["reserved", "free", "violation", "violation", "free", "staged", "free", "free", "free", "free"]
    assert pm.cells.tolist() == [[IX[k] for k in names]]
    # The centre pixel of each cell has the state's colour; the last pixel row/column of a cell is the grid line.
    for col, state in ((0, "reserved"), (2, "violation"), (5, "staged"), (9, "free")):
        assert tuple(pm.image[10, col * 24 + 10]) == COLORS[state]
    assert tuple(pm.image[23, 10]) == BACKGROUND
    assert pm.rule == "1 cell = 1 page; page ids run left to right, 10 per row, page 0 at the top left"
    assert pm.violation_runs == ((2, 3),) and pm.more_violation_runs is False
    assert page_map(owner).violation_runs == ()


def test_violation_runs_say_whether_more_follow():
    # Ten runs exactly are all named (no "more"); an eleventh is not named, and said to follow.
    for n, more in ((10, False), (11, True)):
        owner = np.full(4 * n + 1, FREE, np.int32)
        owner[0] = RESERVED
        owner[1 : 4 * n + 1 : 4] = 5  # one page of slot 5 every 4 pages
        pm = page_map(owner, violation_slots=[5])
        assert pm.violation_runs == tuple((p, p) for p in range(1, 4 * min(n, 10) + 1, 4))
        assert pm.more_violation_runs is more
    assert [(k, n) for k, _, _, n in pm.legend] == [(k, pm.counts[k]) for k in STATES]
    assert dict((k, c) for k, _, c, _ in pm.legend)["violation"] == "#dc2626"


def test_rows_wrap_and_trailing_cells_are_background():
    pm = page_map(initial_owner(39))  # 40 entries, 32 per row -> 2 rows, the last 24 cells empty
    assert pm.cells.shape == (2, 32)
    assert (pm.cells[1, 8:] == len(STATES)).all() and (pm.cells[1, :8] == IX["free"]).all()
    assert tuple(pm.image[24 + 10, 20 * 24 + 10]) == BACKGROUND


def test_a_million_pages_are_downsampled_and_no_violation_is_averaged_away():
    n = 1 << 20  # 1,048,576 pages + page 0
    owner = initial_owner(n)
    owner[1 : n // 2] = 7  # half the pool used by slot 7
    owner[900_001] = 3  # one page of a violating request, in the free half
    owner[1_000_000] = STAGED
    pm = page_map(owner, violation_slots=[3])
    k = pm.pages_per_cell
    assert k == -(-(n + 1) // MAX_CELLS) == 5
    assert pm.columns == 512 and pm.scale == 1
    cells = pm.cells.ravel()
    assert cells.size == 512 * 410  # ceil(ceil(1048577 / 5) / 512) rows of 512
    assert cells[900_001 // k] == IX["violation"]  # one page in 5 is enough
    assert cells[1_000_000 // k] == IX["staged"]
    assert cells[0] == IX["reserved"]  # page 0 (reserved) outranks the used pages 1..4 of its cell
    assert cells[1] == IX["used"] and cells[(n // 2 + 10) // k] == IX["free"]
    assert pm.counts == {"free": n // 2 - 1, "used": n // 2 - 1, "staged": 1, "swa_evicted": 0, "reserved": 1,
                         "violation": 1}  # fmt: skip
    assert pm.image.shape == (410, 512, 3)
    assert pm.violation_runs == ((900_001, 900_001),)  # where the single red pixel is, in page ids
    assert pm.rule.startswith("1 cell = 5 consecutive pages (cell i = pages 5*i ... 5*i+4), 512 cells per row")
    assert pm.rule.endswith("violation > reserved > swa_evicted > staged > used > free")


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1, (1, 1, 1, 24)), (64, (1, 64, 32, 24)), (512, (1, 512, 32, 24)), (513, (1, 513, 64, 12)),
     (4096, (1, 4096, 64, 12)), (5000, (1, 5000, 512, 1)), (MAX_CELLS + 1, (2, MAX_CELLS // 2 + 1, 512, 1))],
)  # fmt: skip
def test_layout(n, expected):
    assert layout(n) == expected


def test_layout_rejects_no_cells():
    with pytest.raises(ValueError, match="max_cells"):
        layout(10, 0)


def test_runs_of():
    mask = np.array([0, 1, 1, 0, 1, 0, 0, 1], bool)
    assert runs_of(mask) == ((1, 2), (4, 4), (7, 7))
    assert runs_of(mask, limit=2) == ((1, 2), (4, 4))
    assert runs_of(np.zeros(5, bool)) == ()
