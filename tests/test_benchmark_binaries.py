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


@pytest.mark.heavy  # three runs of the binary, each compiling its programs: over a minute on a busy machine
def test_benchmark_adaptive_writes_its_ledger_and_table_and_resumes(tmp_path):
    """random:tiny, two HumanEval prompts, fixed K 1 and 2 with prompt lookup (adaptive too where
    the Engine has it): a line per measurement and the table; the adaptive row's second prompt
    starts from the counts its first left; a rerun measures nothing again, and a run cut off (its
    last line gone) measures only what is missing, from the same start."""
    import json

    from experiments import _adaptive_bench

    adaptive = _adaptive_bench.has_adaptive()
    out_dir = tmp_path / "out"
    args = [sys.executable, str(EXP / "benchmark_adaptive.py"), "--model=random:tiny", "--drafts=pld",
            "--methods=exact", "--ks=1,2", "--num_humaneval=2", "--num_mtbench=0", "--max_new_tokens=8",
            f"--output_dir={out_dir}", "--adaptive" if adaptive else "--noadaptive"]

    def run():
        out = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out, (out_dir / "measurements.jsonl").read_text().splitlines()

    out, lines = run()
    configs = [json.loads(line)["config"] for line in lines]
    want = ["target-only", "exact|pld|k=1|fixed", "exact|pld|k=2|fixed"]
    want += ["exact|pld|k=2|adaptive"] if adaptive else []
    assert configs == want * 2
    first = json.loads(lines[1])
    assert first["tokens"] == 8 and first["tokens_per_s"] > 0 and first["dataset"] == "humaneval"
    assert first["model"] == "random:tiny" and ("AVX" in first["machine"] or "cores" in first["machine"])
    table = (out_dir / "table.md").read_text()
    assert table in out.stdout + "\n" or table.strip() in out.stdout
    assert "| exact | pld | 2 | fixed | 2 |" in table and "## HumanEval" in table and "## MT-Bench" not in table
    assert ("## A round with nothing proposed" in table) and (("target steps" in table) == adaptive)
    if adaptive and _adaptive_bench.carries_adaptation():
        mine = [json.loads(l) for l in lines if json.loads(l)["config"].endswith("|adaptive")]
        assert [(m["index"], m["warm_start"]) for m in mine] == [(0, False), (1, True)]
        assert all(len(m["adaptation"]["hits"]) == 4 for m in mine)  # prompt lookup's 4 levels
    (out_dir / "measurements.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    _, resumed = run()  # the others are not measured again
    assert resumed[:-1] == lines[:-1] and json.loads(resumed[-1])["config"] == configs[-1]
    assert json.loads(resumed[-1]).get("warm_start", True)  # resumed from the ledger's earlier line


def test_benchmark_adaptive_table_medians_best_fixed_k_and_verdicts():
    """Ratios are per prompt against that prompt's target-only run, medians over prompts; the best
    fixed K is per (rule, drafter); adaptive is judged against it (5%) and against 1.0x."""
    from experiments import _adaptive_bench as B

    rows = B.rows(["exact"], ["pld"], [2, 4], adaptive=True)
    speeds = {"target-only": [10, 20, 40], rows[0].label: [12, 20, 44], rows[1].label: [15, 18, 60],
              rows[2].label: [14, 19, 58]}  # ratios: k2 1.2 1.0 1.1; k4 1.5 0.9 1.5; adaptive 1.4 0.95 1.45
    lines = [dict(dataset="humaneval", index=i, config=c, tokens_per_s=v, tau=1.0 + i, rounds=10,
                  accepted_counts=[5, 2, 1, 0][: 2 if "k=2" in c else 4] if c != "target-only" else None,
                  widths=[0, 3, 2, 0, 0, 5] if "adaptive" in c else None)
             for c, vs in speeds.items() for i, v in enumerate(vs)]
    summary = {s["row"].label: s for s in B.summarize(lines, rows)}
    assert summary[rows[0].label]["ratio"] == pytest.approx(1.1) and summary[rows[1].label]["ratio"] == 1.5
    adaptive = summary[rows[2].label]
    assert adaptive["ratio"] == pytest.approx(1.4) and adaptive["best_fixed_k"] == 4
    assert adaptive["within_5pct"] is False and adaptive["at_least_1x"] is True and adaptive["tau"] == 2.0
    assert adaptive["widths"] == [0, 9, 6, 0, 0, 15] and summary[rows[1].label]["accepted_counts"] == [15, 6, 3, 0]
    text = B.table(list(summary.values()), lambda k, model_draft: B.cost_table(verify_s=(1.0,) * (k + 1)))
    row = "| exact | pld | 4 | adaptive | 3 | 1.40x | 2.00 | 4 (1.50x) | **no** | yes | 1: 9, 2: 6, 5: 15 | - |"
    assert row in text
    assert "| exact | pld | 4 | fixed | 3 | 1.50x | 2.00 | 4 (1.50x) | - | - | - | 5 (1.80x) |" in text  # width = drafts + 1


def test_benchmark_adaptive_refuses_bad_flags(tmp_path):
    for flag, message in (("--ks=0,2", "--ks"),):  # each a process: one is enough to see the path
        out = subprocess.run([sys.executable, str(EXP / "benchmark_adaptive.py"), "--model=random:tiny", flag,
                              "--noadaptive", f"--output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and message in out.stderr, out.stderr[-2000:]


def test_widths_chosen_under_a_cost_table():
    """The policy's choice from measured acceptance: where a wide verify costs about a step (the
    H200 profile) long drafts are verified; where it costs many steps (a CPU) short ones."""
    from experiments import _adaptive_bench as B

    rounds, accepted = 100, [90, 80, 70, 60, 50, 40, 30, 20]  # position j accepted in accepted[j] rounds
    assert B.expected_tokens(accepted, rounds, 1) == 1.0
    assert B.expected_tokens(accepted, rounds, 3) == 1.0 + 1.7
    cheap = B.cost_table(verify_s=tuple(1.0 + 0.05 * w for w in range(9)))
    dear = B.cost_table(verify_s=tuple(1.0 + 0.8 * w for w in range(9)))
    assert B.chosen_width(accepted, rounds, cheap, range(1, 10))[0] == 9
    assert B.chosen_width(accepted, rounds, dear, range(1, 10)) == (2, pytest.approx(1.9 / 1.8))
    assert B.chosen_width([0] * 8, rounds, cheap, range(1, 10)) == (1, 1.0)  # nothing pays: a plain step
    for model, draft in (("smollm2-135m-instruct", False), ("qwen2.5-coder-1.5b-instruct", True)):
        costs = B.h200_costs(model, 15, draft)
        assert len(costs.verify_s) == 16 and "computed from the H200 profile" in costs.source
        steps = [v / costs.verify_s[0] for v in costs.verify_s]
        assert steps[0] == 1.0 and 1.0 < steps[8] < 1.5 and steps == sorted(steps)
        assert (costs.draft_step_s > 0) == draft
    assert B.h200_costs("llama-3.1-8b", 15, False) is None


def test_generate_default_request_compares_medians_and_says_what_it_shows(tmp_path):
    """README's first command, on a tiny model: the default request, the method against target-only
    as medians of alternating runs, and the line saying why that request and what chat gives."""
    out = subprocess.run([sys.executable, str(EXP / "generate.py"), "--model=random:tiny", "--max_new_tokens=6",
                          "--timing_repeats=2", "--quiet"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ">>> Fix the spelling mistakes in this paragraph:" in out.stdout
    line = next(line for line in out.stdout.splitlines() if line.startswith("target-only:"))
    assert "x, tau" in line and line.endswith("medians of 2 runs each")
    assert "where prompt lookup pays" in out.stdout and "On a free chat question" in out.stdout
