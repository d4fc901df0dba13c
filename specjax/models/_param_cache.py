"""The converted-parameter cache on disk: one safetensors file, small JSON files, a chunked manifest.

An entry is a directory:
- `params.safetensors`: every array of the parameter tree under its flattened path
  ("layers/wq/codes"); the header and every tensor start on a 64-byte boundary (unnamed
  `__pad__.N` byte tensors fill the gaps, so the file stays valid safetensors), so that the
  arrays read into one 64-byte aligned buffer are handed to the CPU device without a copy;
- the metadata files the caller gives (config, quantized-leaf shapes, tokenizer state);
- `manifest.json`, written last: the size of every other file and the SHA-256 of each of its
  8 MiB chunks. A directory without it is incomplete; a file that differs from it is damaged.

Reading never trusts a byte before its chunk's hash matched: the file is read with `os.preadv`
into the aligned buffer by a few threads, each hashing the chunk it just read (hashlib and
preadv release the GIL), so checking costs little beside reading. orbax is not imported.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import os
import pathlib
import shutil

import numpy as np

from specjax._files import LoadError, process_is_gone

PARAMS = "params.safetensors"
MANIFEST = "manifest.json"
CHUNK = 8 << 20  # bytes hashed apart: the unit of parallel reading (and of a partial read)
ALIGN = 64  # the CPU client aliases a host buffer aligned to this instead of copying it
_FORMAT = "specjax-param-cache-1"
_PAD = "__pad__."

# safetensors dtype names (the format's own) of the dtypes a parameter tree holds
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
           "U8": np.uint8, "BOOL": np.bool_}


def _dtype_table():
    import ml_dtypes

    table = {k: np.dtype(v) for k, v in _DTYPES.items()}
    table["BF16"] = np.dtype(ml_dtypes.bfloat16)
    return table, {v: k for k, v in table.items()}


class CacheError(LoadError):
    """A converted-parameter cache that is incomplete, altered or not what this version writes."""


# --- trees <-> flat names -----------------------------------------------------------------------


def flatten(tree, prefix: str = "") -> dict:
    """{"a/b/c": leaf} of nested dicts (what `quant.to_plain` returns)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            if not isinstance(k, str) or not k or "/" in k or k.startswith(_PAD):
                raise TypeError(f"parameter name {k!r} cannot be a cache entry name")
            out.update(flatten(v, f"{prefix}{k}/"))
        return out
    if not prefix:
        raise TypeError("the parameters must be a dict")
    return {prefix[:-1]: tree}


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, leaf in flat.items():
        *parents, last = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise CacheError(f"{PARAMS}: {name} lies below an array")
        if last in node:
            raise CacheError(f"{PARAMS}: {name} is both an array and a group")
        node[last] = leaf
    return tree


# --- writing ------------------------------------------------------------------------------------


def _safetensors_layout(arrays: dict) -> tuple[bytes, list]:
    """(header bytes, [(array or pad byte count, ...)] in file order): every tensor 64-byte aligned."""
    _, names = _dtype_table()
    header, pieces, offset = {"__metadata__": {"format": _FORMAT}}, [], 0
    for name, a in arrays.items():
        if a.dtype not in names:
            raise TypeError(f"{name}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        pieces.append(a)
        offset += a.nbytes
        pad = -offset % ALIGN
        if pad:  # a tensor of its own: safetensors wants the data contiguous, gaps included
            header[f"{_PAD}{len(pieces)}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            pieces.append(pad)
            offset += pad
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # the data starts aligned too
    return len(text).to_bytes(8, "little") + text, pieces


def _write_params(path: pathlib.Path, arrays: dict) -> None:
    head, pieces = _safetensors_layout(arrays)
    with open(path, "wb") as f:
        f.write(head)
        for p in pieces:
            f.write(bytes(p) if isinstance(p, int) else np.ascontiguousarray(p).reshape(-1).view(np.uint8).data)


def chunk_hashes(path: pathlib.Path) -> list[str]:
    out = []
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            out.append(hashlib.sha256(block).hexdigest())
    return out


def sign(directory: pathlib.Path) -> None:
    """Writes `directory/manifest.json` for the files there now (call it last)."""
    files = {f.name: {"size": f.stat().st_size, "sha256": chunk_hashes(f)}
             for f in sorted(directory.iterdir()) if f.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"format": _FORMAT, "chunk": CHUNK, "files": files}, indent=0))


def remove_stale_temporaries(parent: pathlib.Path) -> None:
    """Deletes `<key>.tmp<PID>` directories whose process is gone (a save killed midway)."""
    for tmp in parent.glob("*.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid() or not process_is_gone(int(pid)):
            continue  # its process still runs: maybe saving right now
        shutil.rmtree(tmp, ignore_errors=True)
        logging.warning("removed %s, left by an interrupted save", tmp)


def write(directory: pathlib.Path, arrays: dict, metadata: dict[str, bytes]) -> None:
    """The entry `directory`: `arrays` ({flat name: host array}) and `metadata` ({file name:
    bytes}), written into `<directory>.tmp<PID>`, signed, then renamed into place whole; a
    failure (a full disk) leaves no temporary behind."""
    if PARAMS in metadata or MANIFEST in metadata:
        raise ValueError(f"metadata cannot be named {PARAMS} or {MANIFEST}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory.parent)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        _write_params(tmp / PARAMS, arrays)
        for name, data in metadata.items():
            (tmp / name).write_bytes(data)
        sign(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --- reading ------------------------------------------------------------------------------------


def _manifest(directory: pathlib.Path) -> tuple[int, dict]:
    try:
        doc = json.loads((directory / MANIFEST).read_bytes())
        chunk, files = doc["chunk"], doc["files"]
        ok = (doc["format"] == _FORMAT and type(chunk) is int and chunk > 0 and isinstance(files, dict)
              and all(isinstance(v, dict) and type(v.get("size")) is int and v["size"] >= 0
                      and isinstance(v.get("sha256"), list) and len(v["sha256"]) == math.ceil(v["size"] / chunk)
                      and all(isinstance(h, str) for h in v["sha256"]) for v in files.values()))
        if not ok:
            raise TypeError
    except FileNotFoundError:
        raise CacheError("no manifest.json (an incomplete save, or one by an older version)") from None
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CacheError("manifest.json is not a valid manifest (damaged or truncated)") from None
    present = {f for f in os.listdir(directory) if f != MANIFEST}
    if present != set(files):
        diff = sorted(present ^ set(files))
        raise CacheError(f"files differ from the manifest ({', '.join(diff[:3])}{', ...' if len(diff) > 3 else ''})")
    return chunk, files


def aligned_empty(size: int) -> np.ndarray:
    raw = np.empty(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size]


def _read_into(fd: int, view: np.ndarray, offset: int) -> None:
    done = 0
    while done < view.size:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # no preadv (macOS before 11): one more copy
            data = os.pread(fd, view.size - done, offset + done)
            n = len(data)
            view[done:done + n] = np.frombuffer(data, np.uint8)
        if n == 0:
            raise CacheError("a file shrank while it was read")
        done += n


def _read_file(path: pathlib.Path, entry: dict, chunk: int, wanted=None, buf=None, during=None) -> np.ndarray:
    """The file's bytes in an aligned buffer (`buf`, or a new one), every chunk read checked
    against its SHA-256. `wanted`: the chunk indices to read (None: all); the others are left
    as they were (unread: garbage in a new buffer). `during()` runs in this thread while the
    chunks are read and hashed (they release the GIL)."""
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if size != entry["size"]:
            raise CacheError(f"{path.name} has {size} bytes, the manifest says {entry['size']}: truncated or altered")
        buf = aligned_empty(size) if buf is None else buf
        indices = list(range(len(entry["sha256"])) if wanted is None else sorted(wanted))

        def one(i):
            view = buf[i * chunk:min(size, (i + 1) * chunk)]
            _read_into(fd, view, i * chunk)
            return hashlib.sha256(view).hexdigest() == entry["sha256"][i]

        threads = min(len(indices), os.cpu_count() or 1, 4)
        if threads > 1:
            with concurrent.futures.ThreadPoolExecutor(threads) as ex:
                futures = [ex.submit(one, i) for i in indices]
                if during is not None:
                    during()
                good = [f.result() for f in futures]
        else:
            if during is not None:
                during()
            good = [one(i) for i in indices]
    if not all(good):
        raise CacheError(f"SHA-256 mismatch in {path.name} (chunk {indices[good.index(False)]})")
    return buf


def _parse_params(buf: np.ndarray, limit: int | None = None) -> tuple[int, dict]:
    """(data start, {name: (dtype, shape, begin, end)}) of a safetensors file in `buf`."""
    table, _ = _dtype_table()
    size = buf.size if limit is None else limit
    if size < 8:
        raise CacheError(f"{PARAMS} is shorter than its header")
    n = int.from_bytes(buf[:8].tobytes(), "little")
    if 8 + n > size:
        raise CacheError(f"{PARAMS}: header of {n} bytes overruns the file")
    try:
        header = json.loads(buf[8:8 + n].tobytes())
        if not isinstance(header, dict):
            raise TypeError
    except (ValueError, TypeError):
        raise CacheError(f"{PARAMS}: the header is not JSON") from None
    start, out = 8 + n, {}
    for name, spec in header.items():
        if name == "__metadata__" or name.startswith(_PAD):
            continue
        try:
            dtype, shape, (b, e) = table[spec["dtype"]], tuple(spec["shape"]), spec["data_offsets"]
            if not all(type(d) is int and d >= 0 for d in shape) or not (type(b) is type(e) is int and 0 <= b <= e):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise CacheError(f"{PARAMS}: tensor {name} has an invalid header entry") from None
        if e - b != math.prod(shape) * dtype.itemsize or start + e > buf.size:
            raise CacheError(f"{PARAMS}: tensor {name}'s bytes do not match its shape or lie outside the file")
        out[name] = (dtype, shape, start + b, start + e)
    return start, out


def _views(buf: np.ndarray, layout: dict) -> dict:
    return {name: buf[b:e].view(dtype).reshape(shape) for name, (dtype, shape, b, e) in layout.items()}


def read(directory: pathlib.Path, metadata: tuple[str, ...], during=None) -> tuple[dict[str, bytes], dict]:
    """({name: bytes} of the `metadata` files, {flat name: host array}), every byte checked
    against the manifest first. The arrays are views of one 64-byte aligned buffer.
    `during(metadata bytes)`, if given, runs while the arrays are read (the checked metadata
    turned into objects meanwhile); an exception from it propagates once the reads are done."""
    chunk, files = _manifest(directory)
    missing = [m for m in (PARAMS, *metadata) if m not in files]
    if missing:
        raise CacheError(f"no {missing[0]} in the cache entry")
    meta = {m: _read_file(directory / m, files[m], chunk).tobytes() for m in metadata}
    buf = _read_file(directory / PARAMS, files[PARAMS], chunk, during=None if during is None else lambda: during(meta))
    return meta, _views(buf, _parse_params(buf)[1])


def read_regions(directory: pathlib.Path, metadata: tuple[str, ...], regions) -> tuple[dict[str, bytes], dict]:
    """As `read`, reading of params.safetensors only the chunks that hold its header and the
    bytes `regions(layout)` names ({flat name: [(begin, end) byte offsets in the tensor]}):
    each process of a mesh reads the parts its devices hold. The arrays outside those ranges
    hold unread (unchecked) bytes: index them only inside the ranges."""
    chunk, files = _manifest(directory)
    missing = [m for m in (PARAMS, *metadata) if m not in files]
    if missing:
        raise CacheError(f"no {missing[0]} in the cache entry")
    meta = {m: _read_file(directory / m, files[m], chunk).tobytes() for m in metadata}
    entry, path = files[PARAMS], directory / PARAMS
    if entry["size"] < 8:
        raise CacheError(f"{PARAMS} is shorter than its header")
    buf = _read_file(path, entry, chunk, {0})
    done = {0}
    n = int.from_bytes(buf[:8].tobytes(), "little")
    if 8 + n > entry["size"]:
        raise CacheError(f"{PARAMS}: header of {n} bytes overruns the file")
    wanted = set(range(1, (8 + n - 1) // chunk + 1))
    _read_file(path, entry, chunk, wanted, buf)
    done |= wanted
    _, layout = _parse_params(buf, 8 + n)
    wanted = set()
    for name, ranges in regions(layout).items():
        base = layout[name][2]
        for b, e in ranges:
            if e > b:
                wanted.update(range((base + b) // chunk, (base + e - 1) // chunk + 1))
    _read_file(path, entry, chunk, wanted - done, buf)
    return meta, _views(buf, layout)


def device_regions(targets: dict):
    """For `read_regions`: the byte ranges of each tensor that this process's devices hold under
    `targets` ({flat name: ShapeDtypeStruct with a sharding}), each device's box as the range
    from its first element to its last (row-major: every element of the box lies between)."""

    def regions(layout):
        out = {}
        for name, sds in targets.items():
            if name not in layout or layout[name][1] != tuple(sds.shape):
                continue  # refused later, by the tree's check
            dtype, shape = layout[name][:2]
            strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
            ranges = []
            for index in sds.sharding.addressable_devices_indices_map(shape).values():
                bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
                if any(b >= e for b, e in bounds):
                    continue
                first = sum(b * st for (b, _), st in zip(bounds, strides))
                last = sum((e - 1) * st for (_, e), st in zip(bounds, strides))
                ranges.append((first * dtype.itemsize, (last + 1) * dtype.itemsize))
            out[name] = ranges
        return out

    return regions


def check(directory: pathlib.Path) -> None:
    """Raises `CacheError` unless every file of the entry matches its manifest."""
    chunk, files = _manifest(directory)
    for name, entry in sorted(files.items()):
        _read_file(directory / name, entry, chunk)
