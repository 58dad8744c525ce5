"""`make bench-quick`: every benchmark takes --quick, and one that fails does not hide the rest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import benchscripts

ROOT = Path(__file__).resolve().parent.parent


def test_every_benchmark_takes_quick() -> None:
    scripts = sorted(benchscripts.BENCH.glob("*.py"))
    helps = {s.name: subprocess.Popen([sys.executable, str(s), "--help"], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for s in scripts}
    refused = {}
    for name, proc in helps.items():
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0 or b"--quick" not in out:
            refused[name] = out.decode(errors="replace")[-500:]
    assert refused == {}


def test_make_bench_runs_every_benchmark_and_fails_if_one_did(tmp_path: Path) -> None:
    # A stand-in for the venv's python: records each script, fails one.
    calls = tmp_path / "calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(
        f'#!/bin/sh\necho "$1 $2" >> {calls}\n'
        'case "$1" in *bench/admin.py) exit 3;; esac\nexit 0\n')
    (fake / "python").chmod(0o755)
    done = subprocess.run(
        ["make", "-s", "-o", "setup", "bench", f"BIN={fake}", "BENCH_ARGS=--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "MAKEFLAGS": ""},
    )  # fmt: skip
    ran = calls.read_text().split("\n")[:-1]
    expected = sorted(p for p in benchscripts.BENCH.glob("*.py")
                      if p.name not in ("chaos.py", "soak.py"))
    assert [line.split()[0] for line in ran] == [str(p.relative_to(ROOT)) for p in expected]
    assert all(line.endswith(" --quick") for line in ran)
    assert done.returncode != 0
    assert "benchmarks that failed: bench/admin.py" in done.stdout
