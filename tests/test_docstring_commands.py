"""Every command in a binary's module docstring runs as written, at small sizes.

The commands: the docstring lines of every binary in experiments/ that start with `python
experiments/X.py` or `python -m experiments.X` (any binary's, so audit's calibration commands count
too), with `VAR=value` prefixes, backslash continuations, `# comments` and a trailing `&` (run
beside the next command) as a shell reads them; a line `VAR=value` alone sets $VAR for the commands
after it. The commands run in docstring order (train_draft's and the calibrations' first), one test
each, in one shared temporary directory, so a command reads what an earlier one wrote; a command
whose input an earlier one makes is skipped, saying so, when that one did not run.

How the sizes are reduced: the command runs exactly as written with a few size flags appended
(SMALL below; absl keeps a flag's last value), each appended only where the command's own value is
larger or unset: prompts, problems, new tokens, repetitions, a grid's points. Nothing else is
changed: the models, methods, drafts and options are the docstring's. Paths: a value of an output
flag (--output, --output_dir, --out, --csv, --cache_dir, ...) and any /tmp/ or ~/ path land in this
test's temporary directory (the same path to the same place, so /tmp/csd_memory written by one
command is read by the next); the placeholders of files a user supplies (path/to/model.gguf,
prompts.txt) are given (the SmolLM2 GGUF, a file of two prompts).

Tiers, by what a command needs: random weights only (random:tiny, distributed's tiny, bench_verify
--smoke, bench_kernels) run in CI, but for those over 20 s (SLOW: `heavy`); SmolLM2-135M runs
`heavy`; Qwen2.5-Coder `qwen`; libtpu `tpu_aot` and `heavy`; llama.cpp is skipped (with the
reason) unless its binaries are built where the command says."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXP = ROOT / "experiments"
# Those whose outputs other docstrings read come first.
BINARIES = sorted((p.stem for p in EXP.glob("*.py") if not p.stem.startswith("_") and "__main__" in p.read_text()),
                  key=lambda n: (n not in ("train_draft", "calibrate_csd", "calibrate_asd"), n))

# Size caps per binary: flag -> the largest value a test run uses (a list flag: its first elements).
SMALL: dict[str, dict[str, object]] = {
    "aot_compile": {"batch_size": 1, "max_len": 256},
    "audit": {"mtbench_questions": 1, "humaneval_problems": 1, "mtbench_max_new_tokens": 8,
              "humaneval_max_new_tokens": 8, "batch_size": 1, "speed_problems": 1},
    "bench_decode": {"max_new_tokens": 4, "reps": 1},
    "bench_kernels": {"vocab": ["1000"], "batch": ["1"], "iters": 1, "reps": 1, "warmup": 0},
    "bench_matmul": {"reps": 1, "cache_len": 64, "context": 16},
    "bench_load": {"repeats": 1},
    "benchmark_adaptive": {"num_humaneval": 1, "num_mtbench": 1, "max_new_tokens": 4},
    "bench_verify": {"batch": ["1"], "k": ["4"], "vocab": ["1000"], "base": ["1", "4", "1000"], "reps": 1,
                     "min_time": 0.001, "cache_len": 64, "context": 16},
    "benchmark": {"num_prompts": 1, "max_new_tokens": 8},
    "break_even": {"num_prompts": 1, "max_new_tokens": 8, "k": ["1"], "agreement": ["1", "0.6"]},
    "calibrate_asd": {"num_prompts": 3, "max_new_tokens": 64},  # a mismatch to calibrate on: a strong draft needs tokens
    "calibrate_csd": {"num_prompts": 2, "max_new_tokens": 8, "eval_prompts": 1},
    "cross_vocab_reference": {},
    "cross_vocab_table": {"num_humaneval": 1, "num_mtbench": 1, "max_new_tokens": 8, "ks": ["8"]},
    "device_check": {"max_new_tokens": 4, "reps": 1, "qwen": False},
    "distributed": {"max_new_tokens": 4},
    "first_call": {"num_prompts": 1, "max_new_tokens": 4},
    "generate": {"max_new_tokens": 8},
    "profile_step": {"reps": 2, "cache_len": 64, "context": 16},
    "sweep": {"num_prompts": 1, "max_new_tokens": 8, "ks": ["4"], "thetas": ["0.3"], "windows": ["2"],
              "budgets": ["8"], "gates": ["0.25"], "min_counts": ["2"]},
    "train_draft": {"num_data_prompts": 8, "package_prompts": 8, "gen_tokens": 12, "gen_batch": 8, "seq_len": 32,
                    "val_sequences": 2, "eval_every": 4, "ckpt_every": 2, "log_every": 2, "timing_rounds": 0,
                    "steps": 4},
}
OUTPUT_FLAGS = {"output", "output_dir", "out", "csv", "cache_dir", "json_out", "work_dir", "reuse_from"}
PROMPTS = "Write a Python function that adds two numbers.\nWhat is the capital of France?\n"

_COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*python\s+(?:-m\s+experiments\.(\w+)|experiments/(\w+)\.py)\b")
_ASSIGN = re.compile(r"^([A-Z_]+)=(\S+)$")


def docstring(name: str) -> str:
    return ast.get_docstring(ast.parse((EXP / f"{name}.py").read_text())) or ""


def commands(name: str) -> list[dict]:
    """The docstring's commands in order: {binary, args, env, background, vars} (vars: $VAR in force)."""
    out, shell_vars = [], {}
    lines = docstring(name).splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        i += 1
        if m := _ASSIGN.match(line):
            shell_vars[m.group(1)] = m.group(2)
            continue
        if not (m := _COMMAND.match(line)):
            continue
        words = shlex.split(line, comments=True)
        env = dict(w.split("=", 1) for w in words[:words.index("python")])
        words = words[words.index("python") + 1:]
        words = words[2:] if words[0] == "-m" else words[1:]
        background = bool(words) and words[-1] == "&"
        out.append(dict(binary=m.group(1) or m.group(2), args=words[:-1] if background else words, env=env,
                        background=background, vars=dict(shell_vars), line=line))
    return out


def _flag(word: str) -> tuple[str, str | None] | None:
    m = re.match(r"^--(\w+)(?:=(.*))?$", word)
    return (m.group(1), m.group(2)) if m else None


def pairs(args: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value) per flag of a command, `--flag value` and `--flag=value` alike (value None: a boolean)."""
    out, i = [], 0
    while i < len(args):
        f = _flag(args[i])
        if f and f[1] is None and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((f[0], args[i + 1]))
            i += 2
            continue
        if f:
            out.append(f)
        i += 1
    return out


def _larger(value, cap) -> bool:
    if value is None:
        return True
    if isinstance(cap, list):
        return len(value.split(",")) > len(cap) or value.split(",")[:len(cap)] != cap
    if isinstance(cap, bool):
        return value.lower() not in ("false", "0")
    return float(value) > cap


def small_flags(binary: str, args: list[str]) -> list[str]:
    given = dict(pairs(args))
    out = []
    for flag, cap in SMALL[binary].items():
        if flag in given and not _larger(given[flag], cap):
            continue
        if isinstance(cap, bool):
            out.append(f"--{'' if cap else 'no'}{flag}")
        else:
            out.append(f"--{flag}={','.join(cap) if isinstance(cap, list) else cap}")
    return out


def needs(binary: str, args: list[str]) -> str | None:
    """What a command needs beyond CI's random weights: qwen, llamacpp, libtpu, smollm2, or None."""
    text = " ".join(args)
    given = dict(pairs(args))
    if "qwen" in text.lower() or binary in ("cross_vocab_reference", "cross_vocab_table"):  # Qwen targets
        return "qwen"
    if "llamacpp" in (given.get("peer") or ""):
        return "llamacpp"
    if binary == "aot_compile":
        return "libtpu"
    model = given.get("target" if binary == "train_draft" else "model")
    if (binary == "bench_kernels" or (binary == "bench_verify" and "smoke" in given)
            or (model or ("tiny" if binary == "distributed" else "")).startswith(("random:tiny", "tiny"))):
        return None
    return "smollm2"


# Random weights only, yet over 20 s each on 2 cores (a trainer's three stages; 8 fake devices, two processes).
SLOW = {"train_draft", "distributed"}


def _case_marks(need, name):
    return {None: [pytest.mark.heavy] if name in SLOW else [], "smollm2": [pytest.mark.heavy, pytest.mark.smollm2],
            "qwen": [pytest.mark.qwen], "libtpu": [pytest.mark.heavy, pytest.mark.tpu_aot],
            "llamacpp": [pytest.mark.heavy]}[need]


class Run:
    """Maps a command's paths into `tmp` and starts it."""

    def __init__(self, tmp: pathlib.Path, env: dict):
        self.tmp, self.env = tmp, env
        (tmp / "prompts.txt").write_text(PROMPTS)  # generate's --prompts_file prompts.txt

    def _path(self, value: str) -> str:
        for prefix, into in (("/tmp/", "tmp"), ("~/", "home")):
            if value.startswith(prefix):
                return str(self.tmp / into / value[len(prefix):])
        return str(self.tmp / "out" / value.lstrip("/"))

    def _value(self, flag: str, value: str, shell_vars: dict) -> str:
        value = re.sub(r"\$(\w+)", lambda m: shell_vars[m.group(1)], value)
        if value == "path/to/model.gguf":
            from specjax.models import presets
            return str(presets.resolve("smollm2-135m-instruct"))
        if value == "prompts.txt":
            return str(self.tmp / "prompts.txt")
        if flag in OUTPUT_FLAGS:
            return self._path(value)
        if "/tmp/" in value or "~/" in value:  # a path, or one in a list (--cost_of=none,/tmp/d)
            return ",".join(self._path(v) if v.startswith(("/tmp/", "~/")) else v for v in value.split(","))
        if re.match(r"^[\w.-]+/", value) and (ROOT / value).exists():  # the checkout's files (it runs elsewhere)
            return str(ROOT / value)
        return value

    def inputs(self, c: dict) -> list[str]:
        """The /tmp/ paths a command reads (not its outputs), mapped."""
        return [self._path(v) for f, value in pairs(c["args"]) if value and f not in OUTPUT_FLAGS
                and "llamacpp" not in f for v in value.split(",") if v.startswith(("/tmp/", "~/"))]

    def args(self, c: dict) -> list[str]:
        out, skip = [], False
        ps = iter(pairs(c["args"]))
        for w in c["args"]:
            if skip:
                skip = False
                continue
            f = _flag(w)
            if not f:
                out.append(w)
                continue
            name, value = next(ps)
            if f[1] is None and value is not None:  # `--flag value`
                out += [w, self._value(name, value, c["vars"])]
                skip = True
            elif value is not None:
                out.append(f"--{name}={self._value(name, value, c['vars'])}")
            else:
                out.append(w)
        return out + small_flags(c["binary"], c["args"])

    def start(self, c: dict) -> tuple[list[str], subprocess.Popen]:
        argv = [sys.executable, str(EXP / f"{c['binary']}.py"), *self.args(c)]
        cwd = self.tmp / "cwd"  # a default output (benchmark.csv) lands here, not in the checkout
        cwd.mkdir(exist_ok=True)
        return argv, subprocess.Popen(argv, cwd=cwd, env=dict(self.env, **c["env"]), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)


def missing(need: str | None, c: dict) -> str | None:
    """Why a command cannot run on this machine (None: it can)."""
    if need == "llamacpp":
        d = dict(pairs(c["args"])).get("llamacpp_dir", "")
        if not d or not (pathlib.Path(os.path.expanduser(d)) / "llama-bench").exists():
            return f"needs llama.cpp's binaries at --llamacpp_dir {d!r} (bash scripts/build_llamacpp.sh)"
    if need == "libtpu":
        try:
            import libtpu  # noqa: F401
        except ImportError:
            return "needs libtpu (pip install -e .[tpu-aot])"
    if need in ("qwen", "smollm2"):
        from specjax import models
        names = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"] if need == "qwen" else [
            "smollm2-135m-instruct"]
        try:
            for n in names:
                models.presets.resolve(n)
        except models.PresetError as e:
            return f"needs {need}: {e}"
    return None


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the binaries' own defaults, and distributed's device count is its own
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    return env


def run_group(group: list[dict], tmp: pathlib.Path, timeout: float) -> list[tuple[list[str], int, str]]:
    """Runs commands side by side (a `&` command and the one after it); (argv, status, stderr) each. A
    command whose input an earlier command of the docstring makes, not run here, is skipped."""
    run = Run(tmp, _env())
    for c in group:
        if why := missing(needs(c["binary"], c["args"]), c):
            pytest.skip(f"{c['line']}: {why}")
        for path in run.inputs(c):
            if not os.path.exists(path):
                pytest.skip(f"{c['line']}: its input {path} is made by an earlier command, not run here")
    started = [run.start(c) for c in group]
    results = []
    for argv, proc in started:
        try:
            _, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        results.append((argv, proc.returncode, err))
    return results


def test_the_commands_are_found_and_parsed():
    """Every binary but data.py documents a command; each is parsed into a binary that exists and flags
    that the binary defines; no command elides flags with `...` (it would not run as written)."""
    found = {name: commands(name) for name in BINARIES}
    assert {n for n, cs in found.items() if not cs} <= {"data"}, found
    for name, cs in found.items():
        for c in cs:
            assert "..." not in c["args"], c["line"]
            assert (EXP / f"{c['binary']}.py").is_file(), c["line"]
            assert c["binary"] in SMALL, f"{c['binary']}: no size caps in SMALL"
    assert commands("distributed")[1]["background"] and not commands("distributed")[2]["background"]
    c = next(c for c in commands("audit") if "$CAL" in c["line"])
    assert c["vars"]["CAL"] == "experiments/results/calibration_qwen_mtbench"


def test_small_flags_only_lower_sizes():
    assert small_flags("generate", ["--max_new_tokens", "200"]) == ["--max_new_tokens=8"]
    assert small_flags("generate", ["--max_new_tokens=4"]) == []
    assert small_flags("audit", ["--humaneval_problems", "0"])[:1] == ["--mtbench_questions=1"]
    assert "--humaneval_problems=1" not in small_flags("audit", ["--humaneval_problems", "0"])
    assert small_flags("bench_verify", ["--smoke"])[:1] == ["--batch=1"]
    assert small_flags("device_check", [])[-1] == "--noqwen"
    assert needs("train_draft", ["--target=random:tiny", "--out=/tmp/d"]) is None
    assert needs("generate", []) == "smollm2" and needs("generate", ["--model", "qwen2.5-coder-1.5b-instruct"]) == "qwen"


def groups(name: str) -> list[list[dict]]:
    """The docstring's commands as the shell runs them: a `&` command with the ones after it."""
    out, group = [], []
    for c in commands(name):
        group.append(c)
        if not c["background"]:
            out.append(group)
            group = []
    return out


def _tier(group: list[dict]) -> str | None:
    order = [None, "smollm2", "libtpu", "llamacpp", "qwen"]
    return max((needs(c["binary"], c["args"]) for c in group), key=order.index)


CASES = [pytest.param(name, i, marks=_case_marks(_tier(g), name), id=f"{name}-{i}")
         for name in BINARIES for i, g in enumerate(groups(name))]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One temporary directory for all the commands: a later one reads what an earlier one wrote
    (break_even's --cost_of=/tmp/smollm2-draft is train_draft's --out=/tmp/smollm2-draft)."""
    return tmp_path_factory.mktemp("docstrings")


@pytest.mark.parametrize("name,group", CASES)
def test_the_docstrings_commands_run(name, group, workdir):
    """Each command exits 0 with no traceback; an output it names exists afterwards (a trained draft
    loads)."""
    g = groups(name)[group]
    results = run_group(g, workdir, timeout=2400 if _tier(g) == "qwen" else 900)  # two Qwen loads: minutes each
    for argv, status, err in results:
        assert status == 0 and "Traceback" not in err, f"{shlex.join(argv[1:])}\n{err[-4000:]}"
        for flag, value in pairs(argv[2:]):
            if flag in {"output", "output_dir", "out", "csv", "json_out"} and value:
                assert pathlib.Path(value).exists(), (shlex.join(argv[1:]), value)
        if argv[1].endswith("train_draft.py"):
            from specjax import models

            out = dict(pairs(argv[2:]))["out"]
            assert f"wrote {out}: loaded back and checked" in err, err[-3000:]
            assert models.load(out, cache=False).config.num_layers >= 1
