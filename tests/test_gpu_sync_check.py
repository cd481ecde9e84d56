"""benchmarks/gpu_sync_check.py: the loop runs clean on the CPU (its smoke test), and without CUDA the check says
so instead of pretending (the sync check itself needs a GPU machine)."""

from __future__ import annotations

import torch

from benchmarks import gpu_sync_check


def test_the_loop_runs_clean_on_the_cpu(capsys):
    assert gpu_sync_check.main(["--device", "cpu", "--steps", "40", "--batch", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith(("paged ", "swa "))]
    labels = [label.split()[0] for label, *_ in gpu_sync_check.CONFIGS]
    assert labels == ["bare", "off", "record", "record", "raise", "record"]
    assert rows == [[k, c] for k in ("paged", "swa") for c in labels]
    for kind in ("paged", "swa"):  # every wrapped configuration ran its loop and its final sweep without a finding
        for _, mode, verify, sink in gpu_sync_check.CONFIGS[1:]:
            syncs, per_step = gpu_sync_check.run_loop(kind, torch.device("cpu"), mode, verify, batch=3, steps=33,
                                                      evict_every=8, counting=False, sink=sink)
            assert per_step > 0 and syncs == {}


def test_without_cuda_it_says_so(capsys):
    if torch.cuda.is_available():
        return  # on a GPU machine the real check runs instead (make bench's companion, see the module docstring)
    assert gpu_sync_check.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def test_the_loop_hands_every_other_request_to_the_prefix_cache(monkeypatch):
    # Wrapped in record or raise mode, requests r0 and r2 of 3 hand their whole pages to the cache before their final
    # frees: 53 prompt tokens + 33 decodes are 86 tokens, 5 whole pages (on the SWA pool those the window kept).
    taken = []
    real = gpu_sync_check._cache_insert

    def spy(alloc, ledger, rid, row):
        real(alloc, ledger, rid, row)
        snap = alloc.snapshot()  # deferred verification: the insert's checks run here (the next step() would)
        owned = tuple(int((p.owner == ledger.cache).sum()) for p in snap.values())
        taken.append((rid, row.shape[0], ledger[rid].cache_protected_len, owned))

    monkeypatch.setattr(gpu_sync_check, "_cache_insert", spy)
    evicted = gpu_sync_check._last_eviction(53, 33, 8) // gpu_sync_check.PS
    assert evicted == 1
    for kind in ("paged", "swa"):
        for _, mode, verify, sink in gpu_sync_check.CONFIGS:
            taken.clear()
            gpu_sync_check.run_loop(
                kind, torch.device("cpu"), mode, verify, batch=3, steps=33, evict_every=8, counting=False, sink=sink
            )
            want = [("r0", 80, 80, (5,)), ("r2", 80, 80, (10,))]
            if kind == "swa":
                want = [("r0", 80, 80, (5, 4)), ("r2", 80, 80, (10, 8))]
            assert taken == (want if mode in ("record", "raise") else []), (kind, mode, verify)
