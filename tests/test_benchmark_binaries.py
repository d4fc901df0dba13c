"""The benchmark binaries start, document their flags and refuse bad ones."""

import csv
import pathlib
import subprocess
import sys

import pytest

EXP = pathlib.Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("binary, flag", [("benchmark.py", "--methods"), ("bench_decode.py", "--max_new_tokens"),
                                          ("device_check.py", "--max_new_tokens"), ("bench_matmul.py", "--cache_len"),
                                          ("break_even.py", "--agreement")])
def test_help_documents_flags(binary, flag):
    out = subprocess.run([sys.executable, str(EXP / binary), "--help"], capture_output=True, text=True, timeout=120)
    assert flag.lstrip("-") in out.stdout + out.stderr


def test_benchmark_rejects_an_unknown_method():
    out = subprocess.run([sys.executable, str(EXP / "benchmark.py"), "--methods=exact,nope", "--num_prompts=1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "unknown method(s): nope" in out.stderr


@pytest.mark.parametrize("mesh, message", [("2,1", "the data axis must be 1"), ("4", "must be DATA,MODEL"),
                                           ("1,64", "needs 64 devices")])
def test_benchmark_rejects_a_bad_mesh(mesh, message):
    out = subprocess.run([sys.executable, str(EXP / "benchmark.py"), f"--mesh={mesh}", "--num_prompts=1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and message in out.stderr


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.heavy  # a minute; the meshes' tokens and memory are checked in test_sharding_engine
def test_benchmark_on_a_mesh_prints_memory_per_device(tmp_path):
    """SmolLM2 on a (1, 2) mesh of fake CPU devices: the table, and the bytes per device of the
    parameters halved (MLP and vocabulary split over "model"; 9 heads stay replicated)."""
    env = {**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    common = ["--num_prompts=1", "--max_new_tokens=4", "--methods=exact", "--drafts=pld"]

    def memory_rows(extra):
        out = subprocess.run([sys.executable, str(EXP / "benchmark.py"), *common, *extra,
                              f"--csv={tmp_path / 'b.csv'}"], capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "| specjax | auto | pld | exact |" in out.stdout
        rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| none |")]
        assert len(rows) == 1, out.stdout
        return [float(x) for x in rows[0][1:]]  # target params, draft params, target cache, draft cache, total

    one, two = memory_rows([]), memory_rows(["--mesh=1,2"])
    assert one[1] == two[1] == 0.0  # prompt lookup has no parameters
    assert 0.5 * one[0] < two[0] < 0.8 * one[0]  # attention (a fifth of the bytes) replicated
    assert two[2] == one[2] > 0  # 3 kv heads do not divide 2: the cache is replicated


@pytest.mark.parametrize("matmul, message", [("native,fast", "fast"), ("q8,q8", "(repeated)")])
def test_benchmark_rejects_a_bad_matmul_list(matmul, message):
    out = subprocess.run([sys.executable, str(EXP / "benchmark.py"), f"--matmul={matmul}", "--num_prompts=1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--matmul" in out.stderr and message in out.stderr


def test_bench_matmul_refuses_a_context_without_room():
    out = subprocess.run([sys.executable, str(EXP / "bench_matmul.py"), "--cache_len=64", "--context=60"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--context must leave room" in out.stderr


def test_break_even_scripts_the_agreement_and_exact_keeps_the_target_tokens(tmp_path):
    """A scripted draft always right: every round but the last takes K + 1 tokens; never right: one.
    With or without a costed drafter (its tokens replaced), exact output is the target's either way."""
    path = tmp_path / "b.csv"
    out = subprocess.run([sys.executable, str(EXP / "break_even.py"), "--model=random:tiny", "--datasets=humaneval",
                          "--num_prompts=1", "--max_new_tokens=16", "--k=2", "--agreement=1,0",
                          "--cost_of=none,self:1", f"--csv={path}"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(path.open()))
    assert sorted((r["cost_of"], float(r["agreement"])) for r in rows) == [
        ("none", 0.0), ("none", 1.0), ("self:1", 0.0), ("self:1", 1.0)]
    for r in rows:
        assert float(r["divergence"]) == 0.0
        if float(r["agreement"]) == 0.0:
            assert float(r["tau"]) == 1.0 and float(r["expected_tau"]) == 1.0
        else:  # 15 tokens after the prefill's: rounds of 3 (the last cut short by an EOS or the limit)
            assert float(r["tau"]) > 2.0 and float(r["expected_tau"]) == 3.0
    assert "break-even agreement" in out.stdout and "| self:1 | 2 |" in out.stdout
