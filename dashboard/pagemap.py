"""The page map: one picture of every page of a pool, coloured by state.

Contract:
- Pure: numpy only; no I/O, no Streamlit. ``page_map`` reads an owner-code array (``shadow.py``'s codes: index =
  page id, page 0 included) and returns a ``PageMap`` (an RGB uint8 image, the legend with page counts, the
  downsampling rule in words). Inputs are never mutated.
- States, in the order of the legend: free (FREE, PRISTINE), used (a request slot or USED_UNOWNED), staged
  (STAGED, HELD_SET, HELD_IDS: freed, not yet allocatable), reserved (RESERVED: page 0), SWA-evicted (pages the
  caller names in ``swa_evicted``: free pages that an SWA eviction released), violation (pages owned by one of
  ``violation_slots``: the requests a violation names). A page is counted under exactly one state; the last two
  override the code-derived state.
- Downsampling: at most ``max_cells`` cells. When the pool has more pages, one cell stands for ``k`` consecutive
  page ids (``k = ceil(pages / max_cells)``) and takes the colour of the most severe state among them, by
  ``SEVERITY`` (violation > reserved > SWA-evicted > staged > used > free), so a single page in a violation is
  never averaged away. Cells are laid out row-major, ``columns`` per row; cells past the last page are the
  background colour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from instrumented_alloc.shadow import FREE, HELD_IDS, RESERVED, STAGED, USED_UNOWNED

# State index -> (key, label, RGB). The index is also the severity: a downsampled cell shows its highest index.
_STATES = (
    ("free", "free", (226, 232, 240)),
    ("used", "used", (59, 130, 246)),
    ("staged", "staged (freed, not yet allocatable)", (250, 204, 21)),
    ("swa_evicted", "SWA-evicted (released by an SWA eviction)", (168, 85, 247)),
    ("reserved", "reserved (page 0)", (71, 85, 105)),
    ("violation", "in a violation (owned by a request a violation names)", (220, 38, 38)),
)
STATES = tuple(s[0] for s in _STATES)
LABELS = {k: label for k, label, _ in _STATES}
COLORS = {k: rgb for k, _, rgb in _STATES}
SEVERITY = tuple(reversed(STATES))  # most severe first
BACKGROUND = (255, 255, 255)
_PALETTE = np.array([rgb for _, _, rgb in _STATES] + [BACKGROUND], dtype=np.uint8)
_BG = len(_STATES)
_I = {k: i for i, k in enumerate(STATES)}

MAX_CELLS = 1 << 18  # 262,144 cells: a 512 x 512 picture


@dataclass(frozen=True)
class PageMap:
    """A rendered page map. ``image``: (height, width, 3) uint8; ``cells``: (rows, columns) state index per cell
    (``len(STATES)`` for background); ``counts``: pages per state (every page counted once, page 0 included);
    ``pages_per_cell``; ``columns``; ``scale``: pixels per cell side; ``rule``: the layout and downsampling rule in
    words; ``legend``: (key, label, "#rrggbb", pages) in legend order; ``violation_runs``: the first runs of
    pages in a violation, as (first, last) page ids (``more_violation_runs``: whether more follow)."""

    image: np.ndarray
    cells: np.ndarray
    counts: dict
    pages_per_cell: int
    columns: int
    scale: int
    rule: str
    legend: tuple
    violation_runs: tuple = ()
    more_violation_runs: bool = False  # there are runs after the first ones in violation_runs


_RUNS = 10  # violation runs named under a page map


def runs_of(mask: np.ndarray, limit: int = 10) -> tuple:
    """The first ``limit`` maximal runs of True in ``mask`` as (first, last) indices: where the marked pages are,
    in words (one red page among a million is a single pixel)."""
    padded = np.zeros(mask.size + 2, bool)
    padded[1:-1] = mask
    edges = np.flatnonzero(padded[1:] != padded[:-1])[: 2 * limit]
    return tuple((int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2]))


def classify(owner: np.ndarray, *, violation_slots=(), swa_evicted=None) -> np.ndarray:
    """State index (into ``STATES``) of every page: uint8, same length as ``owner``."""
    owner = np.asarray(owner)
    out = np.zeros(owner.shape, np.uint8)  # free: FREE, PRISTINE and anything below
    out[owner >= USED_UNOWNED] = _I["used"]
    out[(owner >= HELD_IDS) & (owner <= STAGED)] = _I["staged"]
    out[owner == RESERVED] = _I["reserved"]
    if swa_evicted is not None and len(swa_evicted):
        pages = np.asarray(swa_evicted, np.int64)
        pages = pages[(pages >= 0) & (pages < owner.size)]
        pages = pages[owner[pages] <= FREE]  # only while still free: a page handed out again is used
        out[pages] = _I["swa_evicted"]
    slots = np.asarray(sorted({int(s) for s in violation_slots if int(s) >= 0}), np.int32)
    if slots.size:
        out[np.isin(owner, slots)] = _I["violation"]
    return out


def layout(n_pages: int, max_cells: int = MAX_CELLS) -> tuple[int, int, int, int]:
    """(pages_per_cell, cells, columns, scale) for ``n_pages`` entries: small pools get big cells (scale pixels
    per side, up to 24) so that a few dozen pages are still a readable picture; large ones one pixel per cell."""
    if max_cells < 1:
        raise ValueError(f"max_cells must be >= 1, got {max_cells}")
    k = max(1, math.ceil(n_pages / max_cells))
    cells = max(1, math.ceil(n_pages / k))
    columns = min(cells, 32 if cells <= 512 else 64 if cells <= 4096 else 512)
    scale = max(1, min(24, 768 // columns))
    return k, cells, columns, scale


def page_map(owner: np.ndarray, *, violation_slots=(), swa_evicted=None, max_cells: int = MAX_CELLS) -> PageMap:
    """The page map of one pool (see the module contract)."""
    states = classify(owner, violation_slots=violation_slots, swa_evicted=swa_evicted)
    n = states.size
    counts = np.bincount(states, minlength=len(STATES))
    k, cells, columns, scale = layout(n, max_cells)
    rows = math.ceil(cells / columns)
    padded = np.full(rows * columns * k, 0, np.uint8)
    padded[:n] = states
    # A cell shows the most severe state of its pages (the state index is the severity).
    cell = (padded.reshape(-1, k).max(axis=1) if k > 1 else padded).astype(np.uint8)
    cell[cells:] = _BG  # cells past the last page
    grid = cell.reshape(rows, columns)
    image = _PALETTE[grid]
    if scale > 1:
        image = np.repeat(np.repeat(image, scale, axis=0), scale, axis=1)
        if scale >= 6:  # a light grid line between cells, so single pages can be counted
            image[scale - 1 :: scale, :, :] = BACKGROUND
            image[:, scale - 1 :: scale, :] = BACKGROUND
    if k == 1:
        rule = f"1 cell = 1 page; page ids run left to right, {columns} per row, page 0 at the top left"
    else:
        rule = (
            f"1 cell = {k:,} consecutive pages (cell i = pages {k:,}*i ... {k:,}*i+{k - 1:,}), {columns} cells per "
            "row; a cell takes the colour of its most severe page: " + " > ".join(SEVERITY)
        )
    legend = tuple(
        (key, LABELS[key], "#{:02x}{:02x}{:02x}".format(*COLORS[key]), int(counts[i])) for i, key in enumerate(STATES)
    )
    runs = runs_of(states == _I["violation"], limit=_RUNS + 1) if counts[_I["violation"]] else ()
    return PageMap(
        image=image,
        cells=grid,
        counts={key: int(counts[i]) for i, key in enumerate(STATES)},
        pages_per_cell=k,
        columns=columns,
        scale=scale,
        rule=rule,
        legend=legend,
        violation_runs=runs[:_RUNS],
        more_violation_runs=len(runs) > _RUNS,
    )
