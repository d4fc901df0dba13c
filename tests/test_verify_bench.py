"""experiments/bench_verify.py runs end to end (tiny vocabulary, no model), so the binary cannot rot."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_verify_smoke():
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}  # one device is enough
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_verify.py"), "--smoke"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("machine: ") and "jax " in line for line in lines), out.stdout
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    methods = {row.split(" | ")[3].split(" (")[0] for row in rows}
    assert methods == {"greedy", "fly", "asd", "csd", "typical"} and len(rows) == 10, out.stdout
    assert all(float(row.split(" | ")[4]) > 0 for row in rows), out.stdout
    assert "Published" in out.stdout and "asd:" in out.stdout and "fly:" in out.stdout
