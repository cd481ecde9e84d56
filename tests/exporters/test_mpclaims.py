"""exporters/mpclaims.py: claims in a Prometheus multiprocess directory (label sets, the one server), directly.

The exporter's use of them, with real rank processes, is in test_prometheus_multiprocess.py."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys

import pytest

from exporters import mpclaims
from exporters.mpclaims import ClaimError, claim


class Owner:
    """A claim's owner (held weakly by the module)."""


LABELS = {"engine": "e0", "tp_rank": "3"}


def _claim_name(pid: int, start: int, kind: str = "labels") -> str:
    digest = mpclaims._digest(LABELS) if kind == "labels" else "dir"
    return f"kvalloc_{kind}_{digest}_{pid}_{start}.claim"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_dead_holder_is_taken_over_and_marked_dead(tmp_path):
    pid = _dead_pid()
    (tmp_path / _claim_name(pid, 12345)).touch()
    gauges = tmp_path / f"gauge_livesum_{pid}.db"
    gauges.write_bytes(b"x")
    counters = tmp_path / f"counter_{pid}.db"
    counters.write_bytes(b"x")
    owner = Owner()
    c = claim(str(tmp_path), "labels", LABELS, owner)
    assert c.took_over == (pid,)
    assert not gauges.exists() and counters.exists()  # its live gauges leave the aggregate, its counters stay
    assert sorted(p.name for p in tmp_path.glob("*.claim")) == [c.name]
    c.release()
    assert not list(tmp_path.glob("*.claim"))


def test_a_recycled_pid_is_taken_over_without_deleting_the_new_process_files(tmp_path):
    # The dead holder's pid now runs another process (another start time): before, mark_process_dead(pid) deleted
    # that live process's gauges.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = mpclaims._start_time(other.pid)
        assert start is not None
        (tmp_path / _claim_name(other.pid, start + 1)).touch()
        theirs = tmp_path / f"gauge_livesum_{other.pid}.db"
        theirs.write_bytes(b"x")
        c = claim(str(tmp_path), "labels", LABELS, Owner())
        assert c.took_over == (other.pid,)
        assert theirs.exists()
        # The same pid with its real start time is a live holder.
        c.release()
        (tmp_path / _claim_name(other.pid, start)).touch()
        with pytest.raises(ClaimError, match=f"already used by live process {other.pid} "):
            claim(str(tmp_path), "labels", LABELS, Owner())
    finally:
        other.kill()
        other.wait()


def test_entries_that_are_not_claim_files_are_left_alone(tmp_path):
    pid = _dead_pid()
    (tmp_path / _claim_name(pid, 1)).mkdir()  # a directory with a claim's name
    unicode_digits = f"kvalloc_labels_{mpclaims._digest(LABELS)}_\u0661_1.claim"  # ARABIC-INDIC DIGIT ONE
    (tmp_path / unicode_digits).touch()
    c = claim(str(tmp_path), "labels", LABELS, Owner())
    assert c.took_over == ()
    assert (tmp_path / _claim_name(pid, 1)).is_dir() and (tmp_path / unicode_digits).exists()


def test_a_held_directory_lock_times_out_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(mpclaims, "LOCK_TIMEOUT", 0.2)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description: conflicts with the claim's
        with pytest.raises(OSError) as info:
            claim(str(tmp_path), "labels", LABELS, Owner())
        assert info.value.errno == errno.ETIMEDOUT
        assert str(info.value).startswith(
            f"[Errno {errno.ETIMEDOUT}] multiprocess metrics: cannot claim in {tmp_path}: its lock (flock) has been "
            "held for 0.2 s by another process"
        )
    finally:
        os.close(fd)
    claim(str(tmp_path), "labels", LABELS, Owner()).release()


def test_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(OSError, match=r"multiprocess metrics: cannot claim labels in .*nowhere: No such file"):
        claim(str(tmp_path / "nowhere"), "labels", LABELS, Owner())


def test_a_forked_child_does_not_release_the_parents_claim(tmp_path):
    owner = Owner()
    c = claim(str(tmp_path), "serve", None, owner)
    pid = os.fork()
    if pid == 0:  # the child: closing its copy of an exporter releases its copy of the claim
        try:
            c.release()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert (tmp_path / c.name).exists()
    with pytest.raises(ClaimError, match="already served by another exporter of this process"):
        claim(str(tmp_path), "serve", None, Owner())
    c.release()
    assert not (tmp_path / c.name).exists()


def test_an_owner_collected_without_release_is_taken_over(tmp_path):
    c = claim(str(tmp_path), "labels", LABELS, Owner())  # the owner dies at once
    again = claim(str(tmp_path), "labels", LABELS, Owner())
    assert again.name == c.name and again.took_over == ()
