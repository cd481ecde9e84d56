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
