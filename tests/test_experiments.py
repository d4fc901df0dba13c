"""The experiment binaries and the notebook, run end to end on tiny settings.

Binaries run as subprocesses (their real command lines) on `random:tiny`, a
2-layer random model with a byte-level tokenizer (experiments/_common.py), with
K = 2 and a few tokens; the notebook runs on SmolLM2 with its small setting.
They share a JAX compilation cache directory, so identical programs compile once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _interrupt import interrupt_when, interruptible

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # experiments/ is not an installed package
EXP = ROOT / "experiments"
TINY = ["--model", "random:tiny", "--k", "2"]
BINARIES = ("generate", "calibrate_csd", "calibrate_asd", "sweep", "audit")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, not the 8 fake ones of conftest.py
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PYTHONPATH=str(ROOT),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    return env


def start(name, args, env):
    return subprocess.Popen([sys.executable, str(EXP / f"{name}.py"), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run(name, args, env, ok=True):
    code, out, err = finish(start(name, args, env))
    if ok:
        assert code == 0, f"{name} {' '.join(args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return code, out, err


# --- flags: --help and clear errors (processes run two at a time) ----------------------------


HELP_FLAGS = {
    "generate": ["--draft", "--method", "--theta", "--window", "--entropy", "--rule", "--budget", "--gate",
                 "--block_cap", "--suffix", "--min_count", "--tau", "--epsilon", "--delta", "--csd_memory",
                 "--asd_calibration", "--prompts_file", "--batch_size", "--matmul"],
    "calibrate_csd": ["--draft", "--output", "--capacity", "--positions", "--eval_prompts"],
    "calibrate_asd": ["--draft", "--output", "--percentile", "--crosscheck"],
    "sweep": ["--thetas", "--windows", "--ks", "--budgets", "--gates", "--min_counts", "--output_dir"],
    "audit": ["--method", "--mtbench_questions", "--humaneval_problems", "--time_budget_minutes", "--exec_timeout",
              "--batch_size", "--speed_problems", "--compress", "--report"],
}

BAD_FLAGS = [
    ("generate", ["--k", "0"], "--k must be positive"),
    ("generate", ["--draft", "none", "--method", "fly"], "need a --draft"),
    ("generate", [*TINY, "--draft", "self:1", "--method", "fly", "--budget", "3"], "does not apply to method 'fly'"),
    ("generate", ["--model", "no-such-preset"], "cannot load model"),
    ("calibrate_csd", ["--output", "/tmp/x"], "--draft"),
    ("calibrate_asd", [*TINY, "--draft", "pld", "--output", "/tmp/x"], "calibration needs a draft model"),
    ("sweep", ["--output_dir", "/tmp/x", "--thetas", "a,b"], "--thetas must be a comma list"),
    ("audit", ["--output_dir", "/tmp/x", "--method", "fly:bogus=1"], "unknown option 'bogus'"),
    ("audit", ["--output_dir", "/tmp/x", "--temperature", "1", "--method", "fly", "--method", "asd"],
     "--temperature 1: method 'asd' is a temperature-0 rule"),
    ("audit", ["--output_dir", "/tmp/x", "--temperature", "-0.5"], "--temperature must be a finite number >= 0"),
    ("audit", ["--output_dir", "/tmp/x", "--temperature", "inf"], "--temperature must be a finite number >= 0"),
    ("audit", ["--output_dir", "/tmp/specjax-audit-absent-calibration", "--asd_calibration", "/nonexistent/asd.json"],
     "--asd_calibration /nonexistent/asd.json: no such file or directory"),
]


def _pairs(items, launch):
    results = []
    for i in range(0, len(items), 2):
        procs = [launch(item) for item in items[i: i + 2]]
        results += [finish(p, timeout=120) for p in procs]
    return results


def test_every_binary_has_help(env):
    results = _pairs(list(HELP_FLAGS), lambda name: start(name, ["--help"], env))
    for (name, wanted), (code, out, err) in zip(HELP_FLAGS.items(), results):
        assert "Traceback" not in err, err  # (absl's --help exits with status 1)
        for flag in wanted:
            assert flag in out, f"{name} --help lacks {flag}"


def test_bad_flags_are_clear_usage_errors(env):
    results = _pairs(BAD_FLAGS, lambda item: start(item[0], item[1], env))
    for (name, args, message), (code, out, err) in zip(BAD_FLAGS, results):
        assert code != 0, f"{name} {args} should fail"
        assert message in err, f"{name} {args}: expected {message!r} in:\n{err[-2000:]}"
        assert "Traceback" not in err, err[-2000:]


# --- the binaries on a tiny random model -------------------------------------------------------


def test_generate_prints_text_and_statistics(env, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nwrite a haiku\n")
    out_json = tmp_path / "g.json"
    code, out, err = run("generate", [*TINY, "--draft", "self:1", "--method", "fly", "--theta", "0.5", "--window",
                                      "1", "--prompts_file", str(prompts), "--max_new_tokens", "8",
                                      "--output", str(out_json)], env)
    assert ">>> hello there" in out and ">>> write a haiku" in out
    assert "tau:" in out and "loose_share:" in out and "tokens/s" in out
    assert "prompt 2/2" in err  # progress, one prompt at a time
    record = json.loads(out_json.read_text())
    assert record["options"] == {"theta": 0.5, "window": 1}  # only the flags that were set
    assert len(record["tokens"]) == 2 and all(1 <= len(t) <= 8 for t in record["tokens"])
    assert len(record["stats"]["tau_per_request"]) == 2


@pytest.mark.heavy
def test_calibrate_csd_saves_a_memory_that_every_binary_loads(env, tmp_path):
    from experiments import _common as C

    mem = tmp_path / "mem"
    run("calibrate_csd", [*TINY, "--draft", "self:1", "--num_prompts", "2", "--max_new_tokens", "8",
                          "--capacity", "64", "--output", str(mem)], env)
    meta = json.loads((mem / "calibration.json").read_text())
    memory = C.load_csd_memory(mem, vocab_size=258)
    assert memory.capacity == 64
    stored = memory.to_dict()
    assert len(stored) == meta["stored_pairs"] == meta["distinct_pairs"] > 0
    assert sum(stored.values()) == meta["mismatches"] <= meta["positions_compared"]
    assert all(a != b for a, b in stored)  # only disagreements are counted
    code, out, _ = run("generate", [*TINY, "--draft", "self:1", "--method", "csd", "--csd_memory", str(mem),
                                    "--min_count", "0", "--max_new_tokens", "8", "--prompt", "hi"], env)
    assert "csd_memory_capacity: 64" in out


def test_exact_rounds_from_teacher_forcing():
    from experiments import _rounds as R

    # target argmax t and draft argmax d along a sequence of 12 positions (prompt of 2)
    t = np.array([0, 0, 5, 6, 7, 8, 9, 1, 2, 3, 4, 0])
    d = np.array([0, 0, 5, 0, 7, 0, 0, 1, 2, 0, 4, 0])
    rounds = R.exact_rounds(t, d, start=2, end=11, k=2)
    # L=2: d5 ok, mismatch at 3 -> b=1; L=4: ok, mismatch at 5 -> b=1; L=6: mismatch -> b=0;
    # L=7: 1,2 ok -> b=2; L=10: ok, then the sequence ends -> b=1, no mismatch
    assert [tuple(r) for r in rounds] == [(2, 1, True), (4, 1, True), (6, 0, True), (7, 2, False), (10, 1, False)]
    # -1 (a draft of another vocabulary drafted nothing there) ends the round without a mismatch
    d[4], d[8] = -1, -1
    rounds = R.exact_rounds(t, d, start=2, end=11, k=2)
    assert [tuple(r) for r in rounds] == [(2, 1, True), (4, 0, False), (5, 0, True), (6, 0, True), (7, 1, False),
                                          (9, 0, True), (10, 1, False)]


def test_calibrate_asd_follows_the_published_procedure(env, tmp_path):
    from experiments import _rounds as R

    t = np.array([0, 0, 5, 6, 7, 8, 9, 1, 2, 3])
    d = np.array([0, 0, 5, 0, 7, 8, 0, 1, 2, 0])
    regret = np.array([0, 0, 0, 2.0, 0, 0, 0.5, 0, 0, 0.0])
    values, rounds = R.asd_block_values(t, d, regret, 2, 9, 4)
    # K=4: round at 2 stops at b=1 (r=2.0) -> 2.0 / (3/4); round at 4 stops at b=2 (r=0.5) -> 0.5 / (2/4);
    # round at 7: 1, 2 match, position 9 is past the end
    assert values == pytest.approx([2.0 / 0.75, 0.5 / 0.5])
    assert [tuple(r) for r in rounds] == [(2, 1, True), (4, 2, True), (7, 2, False)]

    out_json = tmp_path / "asd.json"
    code, out, _ = run("calibrate_asd", [*TINY, "--draft", "self:1", "--num_prompts", "2", "--max_new_tokens", "8",
                                         "--output", str(out_json), "--crosscheck"], env)
    cal = json.loads(out_json.read_text())
    assert cal["budget"] == cal["gate"] == pytest.approx(np.percentile(cal["values"], 25))
    assert cal["block_cap"] == 1 and cal["suffix"] == "fraction" and cal["k"] == 2
    assert all(v > 0 for v in cal["values"]) and cal["num_values"] == len(cal["values"])
    c = cal["crosscheck"]  # the reconstruction's rounds are the engine's exact speculative decoding
    assert c["tokens_identical"] == c["requests"] == 2 and c["rounds_identical"] == c["compared"] > 0
    code, out, _ = run("generate", [*TINY, "--draft", "self:1", "--method", "asd", "--asd_calibration",
                                    str(out_json), "--max_new_tokens", "8", "--prompt", "hi"], env)
    assert "tau:" in out


@pytest.mark.heavy  # half a minute; each calibration binary is run in its own test
def test_calibrations_share_their_greedy_decoding_through_the_cache(env, tmp_path):
    """calibrate_csd fills --cache_dir; calibrate_asd on the same inputs reads it and
    calibrates exactly as without the cache; other prompts miss the cache."""
    source = [*TINY, "--draft", "self:1", "--num_prompts", "2", "--max_new_tokens", "8"]
    cache = tmp_path / "cache"
    run("calibrate_csd", [*source, "--output", str(tmp_path / "mem"), "--cache_dir", str(cache)], env)
    assert len(list(cache.glob("calibration-*.npz"))) == 1
    _, _, err = run("calibrate_asd", [*source, "--output", str(tmp_path / "a.json"), "--cache_dir", str(cache)], env)
    assert "from " + str(cache) in err and "greedy decoding" not in err
    run("calibrate_asd", [*source, "--output", str(tmp_path / "b.json")], env)
    cached, fresh = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert cached["values"] == fresh["values"] and cached["budget"] == fresh["budget"]
    _, _, err = run("calibrate_asd", [*source, "--prompt_offset", "1", "--output", str(tmp_path / "c.json"),
                                      "--cache_dir", str(cache)], env)
    assert "greedy decoding" in err and len(list(cache.glob("calibration-*.npz"))) == 2


@pytest.mark.heavy
def test_sweep_writes_csv_and_plots(env, tmp_path):
    import csv

    run("sweep", [*TINY[:2], "--draft", "self:1", "--methods", "greedy,fly", "--ks", "2", "--thetas", "0.5",
                  "--windows", "1", "--num_prompts", "2", "--max_new_tokens", "8", "--output_dir", str(tmp_path)], env)
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["target-only", "exact k=2", "fly k=2 theta=0.5,window=1"]
    assert float(rows[1]["divergence"]) == 0.0  # exact verification is the target's greedy output
    assert float(rows[2]["loose_share"]) > 0  # the tiny models disagree often and fly lets some through
    assert all(float(r["speedup"]) > 0 and float(r["tau"]) >= 1 for r in rows)
    for name in ("tau_vs_divergence.png", "speedup_vs_divergence.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_audit_table_with_sandboxed_pass_at_1(env, tmp_path):
    code, out, err = run("audit", [*TINY, "--draft", "self:1", "--method", "exact", "--method",
                                   "fly:theta=0.5,window=1", "--mtbench_questions", "1", "--mtbench_max_new_tokens",
                                   "8", "--humaneval_problems", "1", "--humaneval_max_new_tokens", "8",
                                   "--output_dir", str(tmp_path)], env)
    assert "sandbox self-check: 1 canonical solutions pass, a wrong completion fails" in err
    assert "| exact |" in out and "| fly:theta=0.5,window=1 |" in out
    record = json.loads((tmp_path / "audit.json").read_text())
    s = record["summary"]
    assert s["exact"]["mtbench_divergence"] == 0.0 and s["exact"]["humaneval_divergence"] == 0.0
    assert s["exact"]["humaneval_pass_at_1"] == s["target-only"]["humaneval_pass_at_1"]
    recs = record["parts"]["humaneval"]["methods"][0]["records"]
    assert recs[0]["task_id"] == "HumanEval/0" and "result" in recs[0]
    lines = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["method"]) for r in lines) == sorted(
        (t, m) for t in ("MT-Bench/0", "HumanEval/0") for m in ("target-only", "exact", "fly:theta=0.5,window=1"))
    head, rest = (tmp_path / "audit.md").read_text().split("\n\nAudit:", 1)
    # the table heads with the command that made it, the script named from the repository root
    assert head.startswith("Command (this sitting's, from the repository root; run again, it continues the run):")
    command = " ".join(x.strip().rstrip("\\").strip() for x in head.splitlines()[2:])
    assert command.startswith("python experiments/audit.py ") and f"--output_dir {tmp_path}" in command
    assert shlex.split(command)[2:] == [*TINY, "--draft", "self:1", "--method", "exact", "--method",
                                        "fly:theta=0.5,window=1", "--mtbench_questions", "1",
                                        "--mtbench_max_new_tokens", "8", "--humaneval_problems", "1",
                                        "--humaneval_max_new_tokens", "8", "--output_dir", str(tmp_path)]
    assert rest.startswith(" target random:tiny")


@pytest.mark.heavy  # two audits side by side, about 40 s
def test_audit_samples_at_a_temperature_one_run_per_seed(env, tmp_path):
    args = [*TINY, "--draft", "self:1", "--method", "exact", "--method", "fly", "--mtbench_questions", "1",
            "--mtbench_max_new_tokens", "8", "--humaneval_problems", "0", "--temperature", "1"]
    runs = _pairs([0, 1], lambda seed: start("audit", [*args, "--seed", str(seed), "--output_dir",
                                                       str(tmp_path / str(seed))], env))
    assert all(code == 0 for code, _, _ in runs), runs
    tokens = {}
    for seed in (0, 1):
        settings = json.loads((tmp_path / str(seed) / "run.json").read_text())
        assert settings["temperature"] == 1.0 and settings["seed"] == seed
        for line in (tmp_path / str(seed) / "completions.jsonl").read_text().splitlines():
            r = json.loads(line)
            tokens[seed, r["method"]] = r["tokens"]
    assert tokens[0, "target-only"] != tokens[1, "target-only"]  # sampled, not greedy
    assert "sampled at T = 1, seed 1" in (tmp_path / "1" / "audit.md").read_text()
    code, _, err = run("audit", [*args, "--seed", "1", "--output_dir", str(tmp_path / "0")], env, ok=False)
    assert code != 0 and "--seed 0 -> 1" in err


def test_humaneval_sandbox_and_completion_extraction():
    from experiments import _humaneval as H
    from experiments import data

    problem = data.humaneval_problems(1)[0]
    body = problem["canonical_solution"]
    reply = f"Here it is:\n```python\n{problem['prompt']}{body}```\nDone."
    whole = H.extract_completion(problem, reply)
    assert whole.startswith("\n") and f"def {problem['entry_point']}" in whole
    assert H.extract_completion(problem, f"```\n{body}```") == body  # a body only
    results = H.humaneval_check([problem] * 3, [whole, body, "    return None\n"], timeout=10)
    assert [r["passed"] for r in results] == [True, True, False]


def test_helpers():
    from experiments import _common as C

    assert C.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert C.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert C.first_difference([1, 2], [1, 2, 3]) == 2
    d = C.divergence([[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [6]])
    assert d["divergence"] == pytest.approx(2 / 3) and d["first_diff_min"] == 0
    assert C.parse_method_spec("fly:theta=0.3,window=6,draft=pld,k=4") == (
        "fly", {"theta": 0.3, "window": 6, "draft": "pld", "k": 4})
    tok = C.byte_tokenizer()
    ids = tok.chat_prompt_ids("héllo")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhéllo\nassistant\n"
    assert max(ids) < tok.vocab_size == 258


def test_sweep_plots_recovery_when_measured(tmp_path):
    # In a subprocess: importing a binary defines its absl flags in the global FLAGS, which
    # would collide with another binary imported by a test sharing this (xdist) worker.
    code = f"""
import sys, pathlib
sys.path.insert(0, {str(EXP)!r})
import sweep
rows = [{{"method": "target-only", "tau": 1.0, "speedup": 1.0, "divergence": 0.0, "recovery": 1.0}}]
rows += [{{"method": m, "tau": 1 + i + j, "speedup": 1 + (i + j) / 2, "divergence": j / 4, "recovery": 1 - j / 10}}
         for i, m in enumerate(["exact", "fly", "asd"]) for j in range(3)]
files = sweep.plot(rows, pathlib.Path({str(tmp_path)!r}), "test")
print(sorted(f.name for f in files))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(["speedup_vs_divergence.png", "speedup_vs_recovery.png",
                                                       "tau_vs_divergence.png", "tau_vs_recovery.png"])


def test_csd_memory_files_round_trip(tmp_path):
    from absl import app

    from experiments import _common as C

    C.save_csd_memory(tmp_path / "a", np.array([[1, 2], [3, 4]]), np.array([7, 1]), 16, {})
    memory = C.load_csd_memory(tmp_path / "a", vocab_size=258)
    assert memory.to_dict() == {(1, 2): 7, (3, 4): 1} and memory.capacity == 16
    assert C.load_csd_memory(tmp_path / "a", capacity=4).capacity == 4
    with pytest.raises(app.UsageError, match="token id 4, outside a vocabulary of 4"):
        C.load_csd_memory(tmp_path / "a", vocab_size=4)
    C.save_csd_memory(tmp_path / "empty", np.zeros((0, 2)), np.zeros((0,)), 8, {})  # no mismatch seen
    assert C.load_csd_memory(tmp_path / "empty").to_dict() == {}
    with pytest.raises(app.UsageError, match="no saved memory"):
        C.load_csd_memory(tmp_path / "missing")


def test_pareto_front():
    from experiments._common import pareto

    pts = [(0.0, 1.5), (0.1, 1.4), (0.2, 2.0), (0.3, 1.9), (0.5, 2.5)]
    assert pareto(pts) == [(0.0, 1.5), (0.2, 2.0), (0.5, 2.5)]
    assert pareto([(1.0, 1.0), (0.9, 1.2), (0.8, 0.5)], minimize_x=False) == [(1.0, 1.0), (0.9, 1.2)]


# --- the notebook -------------------------------------------------------------------------------


@pytest.mark.smollm2
@pytest.mark.heavy  # a minute: the notebook's cells run the engine and binaries tested on their own
def test_notebook_runs_end_to_end_in_its_small_setting(env, tmp_path):
    """Every code cell but the install cell (tagged "install"), in order, in a fresh interpreter."""
    from specjax.models import PresetError, presets

    try:
        presets.resolve("smollm2-135m-instruct")
    except PresetError as e:
        pytest.skip(str(e))
    nb = json.loads((EXP / "notebooks" / "specjax_colab.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert any("install" in c["metadata"].get("tags", []) for c in cells)
    code = "\n\n".join("".join(c["source"]) for c in cells if "install" not in c["metadata"].get("tags", []))
    script = tmp_path / "notebook.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], env={**env, "SPECJAX_NOTEBOOK_SMALL": "1"},
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("target-only", "exact", "fly", "asd", "csd"):
        assert f"| {name} |" in proc.stdout


ONE_LINE_ERRORS = {  # what main raises -> the one line the user reads
    "usage": ("raise app.UsageError('--k must be positive')", "error: --k must be positive"),
    "run": ("raise _paths.RunError('step 7: loss nan: training diverged')",
            "error: step 7: loss nan: training diverged"),
    "load": ("raise _files.LoadError('/m/model.safetensors', 'invalid JSON in header')",
             "error: /m/model.safetensors: invalid JSON in header"),
    "tensor": ("raise convert.MissingTensorError('/m/model.safetensors: no tensor model.norm.weight')",
               "error: /m/model.safetensors: no tensor model.norm.weight"),
    "checkpoint": ("raise convert.CheckpointError('/m: q_proj has shape (3, 4), expected (4, 4)')",
                   "error: /m: q_proj has shape (3, 4), expected (4, 4)"),
}


def test_binaries_end_user_errors_with_one_line_and_ctrl_c_with_the_command_to_go_on(env, tmp_path):
    """_paths.run, which every binary's entry goes through: one line for the errors a user acts on (no
    traceback, no flag-help dump), a traceback still for a bug, and Ctrl-C: exit 130, where the run
    stands and the command that continues it."""
    script = tmp_path / "binary.py"
    script.write_text(f'''"""A binary's docstring, which absl's usage dump would print."""
import sys
sys.path.insert(0, {str(ROOT)!r})
from absl import app, flags
from experiments import _paths
flags.DEFINE_string("flag", "", "a flag")
from specjax import _files
from specjax.models import convert

def main(argv):
    kind = argv[1]
    _paths.set_status(lambda: "at step 3/10; the last checkpoint is step 2")
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "bug":
        raise ZeroDivisionError("a bug")
    {"; ".join(f"if kind == {k!r}: {code}" for k, (code, _) in ONE_LINE_ERRORS.items()).replace("; ", chr(10) + "    ")}

_paths.run(main)
''')
    for kind, (_, line) in ONE_LINE_ERRORS.items():
        res = subprocess.run([sys.executable, str(script), kind], env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 1 and res.stderr.strip().splitlines() == [line], (kind, res.stderr[-2000:])
    res = subprocess.run([sys.executable, str(script), "bug"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" in res.stderr and "ZeroDivisionError: a bug" in res.stderr
    res = subprocess.run([sys.executable, str(script), "interrupt", "--flag=a b"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "[specjax] at step 3/10; the last checkpoint is step 2" in res.stderr
    assert f"[specjax] to go on (or run it again): python {script} interrupt '--flag=a b'" in res.stderr


def test_a_damaged_model_is_one_line_naming_the_file_in_every_binary(env, tmp_path):
    """generate and train_draft (--model / --target) on a directory whose weights are cut short."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 258, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True}))
    (bad / "model.safetensors").write_bytes(b"xx")
    procs = [start("generate", ["--model", str(bad)], env),
             start("train_draft", [f"--target={bad}", f"--out={tmp_path / 'draft'}"], env)]
    for proc in procs:
        code, _, err = finish(proc, timeout=180)
        lines = [line for line in err.strip().splitlines() if not line.startswith("[specjax] loading")]
        assert code == 1 and len(lines) == 1, err[-2000:]
        assert lines[0].startswith(f"error: {bad / 'model.safetensors'}: "), err[-2000:]


@pytest.mark.heavy
def test_ctrl_c_in_sweep_says_where_it_stopped_and_how_to_go_on(env, tmp_path):
    """A long binary's Ctrl-C (as in benchmark, calibrate_*, generate, audit): exit 130, no traceback,
    where the run stands and the command to run."""

    args = [*TINY[:2], "--draft", "self:1", "--methods", "fly", "--ks", "2", "--thetas",
            ",".join(str(t / 40) for t in range(1, 41)), "--windows", "1", "--num_prompts", "2", "--max_new_tokens",
            "32", "--output_dir", str(tmp_path / "s")]
    proc = subprocess.Popen([sys.executable, str(EXP / "sweep.py"), *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=interruptible)
    rest = interrupt_when(proc, "theta=0.025,")  # the grid's first point is done
    assert proc.returncode == 130 and "Traceback" not in rest, rest[-2000:]
    assert re.search(r"\[specjax\] stopped at grid point \d+/40; the table is written only at the end", rest), rest
    assert "[specjax] to go on (or run it again): python " in rest and not (tmp_path / "s" / "sweep.csv").exists()
