"""The benchmark binaries start, document their flags and refuse bad ones."""

import pathlib
import subprocess
import sys

import pytest

EXP = pathlib.Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("binary, flag", [("benchmark.py", "--methods"), ("bench_decode.py", "--max_new_tokens"),
                                          ("device_check.py", "--max_new_tokens")])
def test_help_documents_flags(binary, flag):
    out = subprocess.run([sys.executable, str(EXP / binary), "--help"], capture_output=True, text=True, timeout=120)
    assert flag.lstrip("-") in out.stdout + out.stderr


def test_benchmark_rejects_an_unknown_method():
    out = subprocess.run([sys.executable, str(EXP / "benchmark.py"), "--methods=exact,nope", "--num_prompts=1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "unknown method(s): nope" in out.stderr
