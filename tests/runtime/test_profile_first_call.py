"""benchmarks/profile_first_call.py on the CPU: its modes and arguments, and its refusal of a
machine without CUDA (the run itself needs a GPU)."""

from __future__ import annotations

from helpers import benchmarks


def test_the_eager_module_loading_mode_is_asked_for_by_name_only():
    probe = benchmarks.load("profile_first_call")
    assert "call_warm_up_idle_eager" in probe.MODES and "call_warm_up_idle_eager" not in probe.DEFAULT_MODES
    assert set(probe.WARM_UP) <= set(probe.MODES)
    assert probe.WARM_UP["call_warm_up_idle_eager"] == probe.WARM_UP["call_warm_up_idle"] == "plans"


def test_as_a_command_it_refuses_unknown_modes_and_a_machine_without_cuda():
    r = benchmarks.run("profile_first_call", "--modes", "call", "nope", cuda=False)
    assert r.returncode == 2 and "--modes 'call nope'" in r.stderr and "Traceback" not in r.stderr
    r = benchmarks.run("profile_first_call", "--modes", "call,call_warm_up_idle_eager", cuda=False)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
