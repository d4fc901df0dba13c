"""Every binary in experiments/ starts both ways a user runs it: `python -m experiments.X` and
`python experiments/X.py`. experiments/ is a package (installed with the project), so a binary's
imports are the same either way and no module carries an import fallback.

Cheap: one real subprocess per invocation for one binary; for all the others, one interpreter per
invocation style imports jax once and forks a child per binary that sets up `sys.path` and
`__main__` as `python -m` or `python X.py` would, then runs `--help`."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXP = ROOT / "experiments"
BINARIES = sorted(p.stem for p in EXP.glob("*.py")
                  if not p.stem.startswith("_") and "__main__" in p.read_text())

# In the child: the path a real interpreter would have (`python X.py`: the script's folder first, and
# not the cwd; `-m`: the cwd first, here a folder without experiments/), then the binary as __main__.
_DRIVER = r"""
import io, json, os, runpy, sys, contextlib
import jax, absl.flags  # imported once, before the forks
how, root, names = sys.argv[1], sys.argv[2], sys.argv[3:]
base = [p for p in sys.path[1:] if os.path.abspath(p or ".") != os.path.abspath(".")]
results = {}
for name in names:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out = io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if how == "script":
                    path = os.path.join(root, "experiments", name + ".py")
                    sys.path[:] = [os.path.dirname(path)] + base
                    sys.argv = [path, "--help"]
                    runpy.run_path(path, run_name="__main__")
                else:
                    sys.path[:] = [os.getcwd()] + base
                    sys.argv = ["-m", "--help"]
                    runpy.run_module("experiments." + name, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 99
        os.write(w, json.dumps([code, out.getvalue()]).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while (chunk := os.read(r, 1 << 16)):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    results[name] = json.loads(b"".join(chunks))
print(json.dumps(results))
"""


def _env() -> dict:
    # PYTHONPATH: this checkout's experiments/ and specjax/ even where the editable install points elsewhere
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def _flags(text: str) -> list[str]:
    return sorted(set(re.findall(r"^\s+--(?:\[no\])?(\w+)", text, re.M)))


@pytest.fixture(scope="module")
def helps() -> dict[str, dict[str, tuple[int, str]]]:
    out = {}
    for how in ("script", "module"):
        proc = subprocess.run([sys.executable, "-c", _DRIVER, how, str(ROOT), *BINARIES], capture_output=True,
                              text=True, cwd=ROOT.parent, env=_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[how] = {k: tuple(v) for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}
    return out


def test_the_binaries_are_found():
    assert {"audit", "benchmark", "generate", "sweep", "train_draft"} <= set(BINARIES)


@pytest.mark.parametrize("name", BINARIES)
def test_help_both_ways(helps, name):
    """absl's --help prints the flags and exits 1; the two invocations print the same flags."""
    (code_s, text_s), (code_m, text_m) = helps["script"][name], helps["module"][name]
    for code, text in ((code_s, text_s), (code_m, text_m)):
        assert "Traceback" not in text and code == 1, text[-3000:]
    assert _flags(text_s) == _flags(text_m) and _flags(text_s)


def test_real_invocations_of_one_binary():
    """The same, as real command lines (no fork): `python -m` from outside the checkout, and the script."""
    runs = [subprocess.run([sys.executable, *cmd, "--help"], capture_output=True, text=True, cwd=cwd, env=_env(),
                           timeout=300)
            for cmd, cwd in ((["-m", "experiments.generate"], ROOT.parent), ([str(EXP / "generate.py")], ROOT))]
    for r in runs:
        assert r.returncode == 1 and "Traceback" not in r.stderr and "--max_new_tokens" in r.stdout + r.stderr, r.stderr
    assert _flags(runs[0].stdout + runs[0].stderr) == _flags(runs[1].stdout + runs[1].stderr)


def test_no_import_fallbacks():
    """A module imports `experiments.X`, never a bare `X` as a fallback for when the package is missing."""
    for path in sorted(EXP.rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(import _[a-z]\w*|from _[a-z]\w* import)", text, re.M), path
        for m in re.finditer(r"except ImportError:.*\n((?:[ \t]+.*\n){1,3})", text):
            assert not re.search(r"^\s*(import|from) ", m.group(1), re.M), (path, m.group(0))
