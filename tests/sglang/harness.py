"""Runs SGLang's real Engine for a test (``driver.py`` in a process of its own) and reads what the plugin wrote.

``run(tmp_path, model=..., engine=..., env=..., workloads=..., deadline=...)`` returns a ``Run``: the driver's
results, its exit code and log, and the recordings (``Recording`` objects, one per rank) the plugin wrote into the
run's ``KVALLOC_RECORD_DIR``. A missing SGLang stops the test through ``tests.ci.missing`` (a failure under CI).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.ci import missing

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VERSION = "0.5.23"


def need_sglang() -> None:
    try:
        from importlib.metadata import version

        found = version("sglang")
    except Exception as exc:  # PackageNotFoundError and friends
        missing(f"SGLang is not installed ({exc}); `make test` installs it")
        return
    if found != SGLANG_VERSION:
        missing(f"SGLang {found} is installed; these tests run SGLang {SGLANG_VERSION}")


@dataclass
class Run:
    returncode: int
    log: str
    results: dict
    record_dir: Path
    recordings: list = field(default_factory=list)

    @property
    def recording(self):
        assert len(self.recordings) == 1, [r.path for r in self.recordings]
        return self.recordings[0]

    def workload(self, kind: str) -> dict:
        found = [w for w in self.results.get("workloads", []) if w["kind"] == kind]
        assert len(found) == 1, (kind, self.results)
        return found[0]


def run(tmp_path: Path, *, model: str = "dense", engine: dict | None = None, env: dict | None = None,
        workloads: list, deadline: float = 240, name: str = "run") -> Run:  # fmt: skip
    from exporters.recorder import Recording

    need_sglang()
    base = tmp_path / name
    base.mkdir(parents=True, exist_ok=True)
    record_dir = base / "recordings"
    env = {"KVALLOC_MODE": "raise", "KVALLOC_RECORD_DIR": str(record_dir), "KVALLOC_SWEEP_INTERVAL": "0", **(env or {})}
    spec = {
        "model": model,
        "model_dir": str(base / f"model-{model}"),
        "engine": engine or {},
        "env": env,
        "workloads": workloads,
        "out": str(base / "results.json"),
        "deadline": deadline,
    }
    spec_path = base / "spec.json"
    spec_path.write_text(json.dumps(spec))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVALLOC_", "OTEL_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sglang.driver", str(spec_path)],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=deadline + 60,
        check=False,
    )
    results = json.loads(Path(spec["out"]).read_text()) if Path(spec["out"]).exists() else {}
    recordings = [Recording(p) for p in sorted(glob.glob(str(record_dir / "*.sqlite")))]
    return Run(proc.returncode, proc.stdout + proc.stderr, results, record_dir, recordings)


def describe(run: Run) -> str:
    """What a failed assertion shows: the violations and the end of the log."""
    lines = [f"exit {run.returncode}, phase {run.results.get('phase')}"]
    for rec in run.recordings:
        for v in rec.violations()[:20]:
            lines.append(f"  {v.invariant} step {v.step} op {v.op} rid {v.rid}: {v.message}")
    lines.append(run.log[-4000:])
    return "\n".join(lines)
