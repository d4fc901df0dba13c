"""train_draft.py's files: the output and work paths checked before any work, the record of what
made a work directory (refusing a rerun that would mix settings), and the checked, atomic export.

WORK/made_by.json records two groups of settings. "data" (the target's identity, the prompts,
--gen_tokens, ...) made WORK/data; "training" (the draft's shape, the recipe, the rows) made
WORK/ckpt. A rerun compares a group only when what it made is there: with data present a changed
data setting refuses, with checkpoints present a changed training setting refuses, each in one
line naming the flag. --steps may change; the line says that the schedule changed with it.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
from absl import app

from specjax import _files

from experiments import _common as C
from experiments import _paths
from experiments import _train_loop as TL

RECORD = "made_by.json"


# --- paths --------------------------------------------------------------------------------------

def is_draft_dir(path: pathlib.Path) -> bool:
    from specjax.models import feature_draft

    return (path / "config.json").is_file() or feature_draft.is_feature_draft(path)


def check_paths(out: pathlib.Path, work: pathlib.Path) -> None:
    """Before any work: --out can be written (or replaced whole: its parent takes a new directory) and
    holds nothing but an earlier draft; --work_dir can be created or filled, and is not inside --out."""
    _paths.check_output("out", out, dir=True)
    _paths.check_output("work_dir", work, dir=True)
    a_out, a_work = os.path.abspath(out), os.path.abspath(work)
    if a_work == a_out or a_work.startswith(a_out + os.sep):
        raise app.UsageError(f"--work_dir {work} lies inside --out {out}, which an export replaces whole")
    if out.is_dir():
        if any(out.iterdir()) and not is_draft_dir(out):
            raise app.UsageError(f"--out {out}: a directory that holds other files, not a draft; an export "
                                 f"replaces it whole: give a new path")
        _paths.check_output("out", out.parent, dir=True)  # the export is renamed in beside it


# --- what made a work directory -------------------------------------------------------------------

def target_identity(spec: str) -> dict:
    """A preset or random:tiny by its name (presets are checked by their checksum on load); a file
    or directory by its resolved path and the size and mtime of its files."""
    p = pathlib.Path(spec)
    if not p.exists():
        return {"target": spec}
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file())
    return {"target": str(p.resolve()),
            "target_files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def _has_data(work: pathlib.Path) -> bool:
    return any((work / "data").glob("chunk_*.npz")) if (work / "data").is_dir() else False


def _differs(name: str, new, old, work: pathlib.Path) -> str:
    if name == "target_files":
        return (f"the target's files changed since {work} was made ({json.dumps(old)[:200]}): its data are of "
                f"the earlier files; use another --work_dir or remove {work}")
    return (f"--{name}={new} differs from the work directory's {old} ({work / RECORD}): use another --work_dir "
            f"or remove {work}")


def check_record(work: pathlib.Path, *, data: dict, training: dict, steps: int) -> None:
    """Refuses (RunError, one line) a setting that differs from what made the data or checkpoints there,
    then records this run's settings (module docstring)."""
    path = work / RECORD
    has_data, has_ckpt = _has_data(work), bool(TL.checkpoint_steps(work / "ckpt"))
    old = None
    if path.exists():
        try:
            old = json.loads(path.read_text())
            old["data"], old["training"]  # noqa: B018 (both groups must be there)
        except (ValueError, KeyError, TypeError):
            raise _paths.RunError(f"{path}: damaged (not the record of a work directory); remove {work} "
                                  f"to start over") from None
    elif has_data or has_ckpt:
        C.log(f"{work} has no record of the settings that made it (an earlier version of this binary): "
              f"taking this run's as its own")
    if old is not None:
        groups = [("data", data, has_data or has_ckpt), ("training", training, has_ckpt)]
        for group, new, made in groups:
            if not made:
                continue
            for name in sorted(set(new) | set(old[group])):
                if new.get(name) != old[group].get(name):
                    raise _paths.RunError(_differs(name, new.get(name), old[group].get(name), work))
        if has_ckpt and old.get("steps") not in (None, steps):
            C.log(f"--steps={steps} differs from the work directory's {old['steps']}: the learning-rate "
                  f"schedule changes with it (warmup, then cosine decay to step {steps}), from the checkpoint on")
    work.mkdir(parents=True, exist_ok=True)
    _paths.write_text(path, json.dumps({"data": data, "training": training, "steps": steps}, indent=1))


# --- export ---------------------------------------------------------------------------------------

def finite(tree) -> bool:
    import jax

    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree)
               if np.issubdtype(np.asarray(x).dtype, np.floating))


def export_checked(out: pathlib.Path, write, verify, work: pathlib.Path) -> None:
    """write(tmp) fills a sibling temporary directory, its checksum manifest is added, verify(tmp)
    loads it back (raising on any problem), and only then it replaces `out`. Any failure: RunError,
    and `out` is as it was (an earlier draft there kept byte for byte)."""
    earlier = out.exists()
    keep = (f"the earlier draft at {out} is unchanged" if earlier else f"nothing was written at {out}")
    again = f"the trained checkpoint is in {work / 'ckpt'}: the same command exports it again"
    tmp_dir = None
    try:
        with _files.atomic_directory(out) as tmp:
            tmp_dir = str(tmp)
            _paths._PENDING.add(tmp_dir)  # Ctrl-C removes it
            write(tmp)
            _files.write_manifest(tmp)
            verify(tmp)
    except OSError as e:
        raise _paths.RunError(f"cannot write the draft to {out}: {e.strerror or e}"
                              f"{f' ({e.filename})' if e.filename else ''}; {keep}; {again}") from None
    except (_files.LoadError, ValueError) as e:
        raise _paths.RunError(f"the exported draft does not check ({e}); {keep}; {again}") from None
    finally:
        _paths._PENDING.discard(tmp_dir)


def verify_model_draft(tmp: pathlib.Path, cfg) -> None:
    """The exported model draft loads with models.load (no cache) into the same shape, finite."""
    from specjax import models

    draft = models.load(tmp, cache=False)
    if draft.config.hidden_size != cfg.hidden_size or draft.config.num_layers != cfg.num_layers:
        raise ValueError(f"it loads as width {draft.config.hidden_size}, {draft.config.num_layers} layers")
    if not finite(draft.params):
        raise ValueError("its weights hold values that are not finite")
    logits = np.asarray(draft.logits(np.ones((1, 4), np.int32)))
    if not np.isfinite(logits).all():
        raise ValueError("its logits are not finite")


def verify_feature_draft(tmp: pathlib.Path) -> None:
    from specjax.models import feature_draft

    draft = feature_draft.load(tmp)
    if not finite(draft.params):
        raise ValueError("its weights hold values that are not finite")
