"""scripts/gpu_session.sh, checked on the CPU before a GPU window spends a minute finding a typo.

A GPU is lent for about 15 minutes a session, start-up included, so the pass runs once. Every command it starts is
checked here as far as a CPU can: each pytest call's flags parse (a plugin flag such as ``--timeout`` needs its
plugin, which ``scripts/gpu_wheels.sh`` must bring) and its ``-k`` selects tests; each benchmark's flags are ones it
takes; each ``--only`` row of ``bench_vs_trl.py`` exists in its ``--setup``. Nothing here needs CUDA: the gpu tests are
collected, not run.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def commands(tool: str) -> list[list[str]]:
    """The argument lists after ``python3 <tool>`` in the script (continuation lines joined, redirections and the
    shell's default values resolved), one per call."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", text)  # ${TESTS_K:-expr}: the default
    text = re.sub(r"\$\{\w+:\+[^}]*\}|\$steps\b", "", text)  # ${X:+--only $X}, $steps: empty unless set
    out = []
    for line in text.splitlines():
        for match in re.finditer(rf"python3 {re.escape(tool)} (.*?)(?:>>|>|;;|$)", line):
            out.append(shlex.split(match.group(1).replace('"$out/', '"/tmp/out/').replace("$out/", "/tmp/out/")))
    return out


def test_the_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_every_pytest_call_parses_and_selects_tests():
    calls = commands("-m pytest")
    assert len(calls) >= 4, calls  # varlen, tests, tests-compile, tests-flex
    for args in calls:
        done = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"pytest {' '.join(args)}:\n{done.stdout[-1500:]}{done.stderr[-1500:]}"
        collected = re.search(r"(\d+) tests? collected", done.stdout)
        assert collected and int(collected.group(1)) > 0, f"pytest {' '.join(args)} selects no test:\n{done.stdout[-800:]}"


def test_the_wheels_bring_every_pytest_plugin_the_calls_use():
    flags = {flag for args in commands("-m pytest") for flag in args if flag.startswith("--")}
    wheels = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    if "--timeout" in flags:
        assert "pytest-timeout" in wheels, "gpu_session.sh passes --timeout: gpu_wheels.sh must fetch pytest-timeout"


@pytest.mark.parametrize("script", ["benchmarks/bench_vs_trl.py", "benchmarks/memory_calibration.py",
                                    "benchmarks/gpu_constants.py"])
def test_every_benchmark_flag_is_one_it_takes(script):
    calls = commands(script)
    assert calls, f"{script} is not called by the script any more: drop it here"
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1500:]
    for args in calls:
        for flag in (a for a in args if a.startswith("--")):
            assert re.search(rf"(^|\s){re.escape(flag)}\b", done.stdout), f"{script} takes no {flag}"


def test_every_speed_row_exists_in_its_setup():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_vs_trl
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for args in commands("benchmarks/bench_vs_trl.py"):
        setup = args[args.index("--setup") + 1]
        rows = bench_vs_trl.variants(bench_vs_trl.SETUPS[setup])
        names = list(itertools.takewhile(lambda a: not a.startswith("--"), args[args.index("--only") + 1:]))
        missing = [name for name in names if name not in rows]
        assert not missing, f"--setup {setup}: no row named {missing}; its rows: {list(rows)}"
