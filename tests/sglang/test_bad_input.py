"""Bad input and failing exporters, inside SGLang:
- an unknown ``KVALLOC_MODE``, an SGLang version the plugin does not support, or a hook that did not apply stop
  the process at start with one clear message, never a silently half-instrumented engine;
- an unwritable ``KVALLOC_RECORD_DIR`` or a taken ``KVALLOC_METRICS_PORT`` leave SGLang serving: those run on
  engines ``test_clean_traffic.py`` starts anyway."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.sglang import harness

pytestmark = pytest.mark.sglang


def python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (SGLang's plugins load once per process), with ``env`` added."""
    harness.need_sglang()
    child = {k: v for k, v in os.environ.items() if not k.startswith("KVALLOC_")}
    child.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=harness.ROOT, env=child,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_an_unknown_mode_stops_the_engine_at_start(tmp_path):
    from instrumented_alloc.sglang_plugin import tiny_model

    model = tiny_model.write(str(tmp_path / "m"))
    out = python(
        f"""
        import sglang as sgl
        if __name__ == "__main__":
            sgl.Engine(model_path={model!r}, load_format="dummy", device="cpu", attention_backend="torch_native")
            print("STARTED")
        """,
        KVALLOC_MODE="bogus",
    )
    assert out.returncode == 1 and "STARTED" not in out.stdout
    assert out.stderr.strip().splitlines()[-1] == (
        "instrumented-alloc: KVALLOC_MODE='bogus': expected one of record, raise (or off / unset to leave SGLang "
        "uninstrumented)"
    )


def test_off_and_unset_leave_sglang_uninstrumented():
    out = python(
        """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.mem_cache import allocation
        from instrumented_alloc.sglang_plugin import session
        print(session.current(), hasattr(allocation.alloc_for_extend, "__wrapped__"))
        """,
        KVALLOC_MODE="off",
    )
    assert out.returncode == 0 and out.stdout.split() == ["None", "False"], out.stderr


def test_an_unsupported_sglang_version_is_refused_naming_the_supported_one():
    out = python(
        """
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: "0.6.0" if name == "sglang" else real(name)
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print("LOADED")
        """,
        KVALLOC_MODE="record",
    )
    assert out.returncode == 1 and "LOADED" not in out.stdout
    assert out.stderr.strip().splitlines()[-1] == (
        "instrumented-alloc: the SGLang plugin supports sglang 0.5.23; this is sglang 0.6.0 (unset KVALLOC_MODE to "
        "run SGLang without it)"
    )


def test_a_hook_that_did_not_apply_stops_the_process_naming_it():
    # SGLang's registry logs a target it fails to patch and goes on: the plugin's check must catch it.
    out = python(
        """
        from sglang.srt.plugins.hook_registry import HookRegistry
        apply = HookRegistry._apply_target.__func__
        def failing(cls, target, hooks):
            if target.endswith("alloc_for_decode"):
                raise RuntimeError("simulated")
            return apply(cls, target, hooks)
        HookRegistry._apply_target = classmethod(failing)
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print("LOADED")
        """,
        KVALLOC_MODE="record",
    )
    assert out.returncode == 1 and "LOADED" not in out.stdout
    assert "Failed to apply hooks to sglang.srt.mem_cache.allocation.alloc_for_decode" in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "instrumented-alloc: these SGLang hooks did not apply (see SGLang's 'Failed to apply hooks' log above): "
        "sglang.srt.mem_cache.allocation.alloc_for_decode"
    )


def test_a_hook_target_missing_from_sglang_is_named():
    out = python(
        """
        import sglang.srt.mem_cache.allocation as allocation
        del allocation.alloc_for_spec_decode
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print("LOADED")
        """,
        KVALLOC_MODE="raise",
    )
    assert out.returncode == 1 and "LOADED" not in out.stdout
    assert re.search(
        r"^instrumented-alloc: hook target sglang\.srt\.mem_cache\.allocation\.alloc_for_spec_decode is not in this "
        r"SGLang: .*alloc_for_spec_decode",
        out.stderr.strip().splitlines()[-1],
    ), out.stderr[-2000:]


def test_an_unknown_fault_is_refused():
    out = python("from sglang.srt.plugins import load_plugins\nload_plugins()\nprint('LOADED')\n",
                 KVALLOC_MODE="record", KVALLOC_INJECT="leak,bogus")  # fmt: skip
    assert out.returncode == 1 and "LOADED" not in out.stdout
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith("instrumented-alloc: KVALLOC_INJECT: unknown faults bogus (known: leak, no-release, ")
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVALLOC_MODE": "record", "KVALLOC_LEDGER": "later"},
         "instrumented-alloc: KVALLOC_LEDGER='later': expected one of deferred, immediate"),
        ({"KVALLOC_MODE": "raise", "KVALLOC_LEDGER": "deferred"},
         "instrumented-alloc: KVALLOC_LEDGER='deferred' with KVALLOC_MODE=raise: raise mode refuses a bad length as "
         "SGLang writes it, which needs immediate (the default there)"),
    ],
    ids=["unknown", "raise-deferred"],
)  # fmt: skip
def test_a_ledger_setting_the_mode_cannot_run_with_is_refused(env, message):
    out = python("from sglang.srt.plugins import load_plugins\nload_plugins()\nprint('LOADED')\n", **env)
    assert out.returncode == 1 and "LOADED" not in out.stdout
    assert out.stderr.strip().splitlines()[-1] == message


def test_record_mode_leaves_sglangs_length_writes_unrouted_unless_immediate():
    code = """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from instrumented_alloc.sglang_plugin import kvrecord, session
        field = type(ReqKvInfo.__dict__["kv_allocated_len"]).__name__
        print(session.current().deferred, kvrecord.routed(ReqKvInfo), field)
        """
    assert python(code, KVALLOC_MODE="record").stdout.split() == ["True", "False", "member_descriptor"]
    immediate = python(code, KVALLOC_MODE="record", KVALLOC_LEDGER="immediate")
    assert immediate.stdout.split() == ["False", "True", "property"]
