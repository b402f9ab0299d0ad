"""Reading a params checkpoint's arrays straight from their zarr v2 files, hashed as read.

`params_io.save_params` writes each parameter as an uncompressed zarr v2 array (no OCDBT): its
chunks are files of raw C-order bytes. A server loading a new version reads each chunk file
once into a host buffer and hashes those same bytes against the checkpoint's manifest
(`rl.model.integrity`), instead of Orbax reading them through tensorstore while a second
pass re-reads them to hash. On a 2-core machine a 50M model's 196 MiB load takes 0.24 cpu-s
this way against 0.54 through Orbax (restore 0.40 + verification 0.14).

    arrays = read_arrays(params_dir, layout)   # {"layers.attn.q": ndarray, ...} or None
    buf = host_array(shape, dtype)             # a pooled buffer, for a copy made anyway

A checkpoint laid out any other way (OCDBT, zarr3, a codec or filter, Fortran order, a
missing chunk, an unknown dtype) gives None, and the caller reads it with Orbax, which reads
every layout it wrote.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rl.model.integrity import CheckpointError, still_unchanged, verify_contents

ZARRAY = ".zarray"
_BLOCK = 8 << 20  # bytes per read + hash update: big enough that hashlib drops the GIL
_ALIGN = 64


def _dtype(name: str) -> np.dtype | None:
    try:
        return np.dtype(name)
    except TypeError:  # tensorstore's extension names, e.g. "bfloat16"
        import ml_dtypes

        found = getattr(ml_dtypes, name, None)
        return np.dtype(found) if found is not None else None


class _Plan(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    chunk: tuple[int, ...]  # every chunk file holds this shape (an edge chunk is padded)
    files: list[tuple[tuple[slice, ...], Path]]  # where in the array each chunk file goes


def _plan(array_dir: Path) -> _Plan | None:
    """How to read a plain zarr v2 array, or None if it is not one this module reads."""
    try:
        meta = json.loads((array_dir / ZARRAY).read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(meta, dict)
        or meta.get("zarr_format") != 2
        or meta.get("compressor")
        or meta.get("filters")
        or meta.get("order") != "C"
    ):
        return None
    dtype, shape, chunk = _dtype(str(meta.get("dtype"))), meta.get("shape"), meta.get("chunks")
    if (
        dtype is None
        or dtype.hasobject
        or not isinstance(shape, list)
        or not isinstance(chunk, list)
        or len(shape) != len(chunk)
        or not all(isinstance(n, int) and n > 0 for n in chunk)
    ):
        return None
    sep = meta.get("dimension_separator", ".")
    grid = [range(math.ceil(n / c)) for n, c in zip(shape, chunk, strict=True)]
    files = []
    for index in itertools.product(*grid):
        file = array_dir / (sep.join(map(str, index)) if index else "0")
        if not file.is_file() or file.stat().st_size != math.prod(chunk) * dtype.itemsize:
            return None  # a fill-value chunk or a foreign layout: Orbax knows what to do
        where = tuple(
            slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, chunk, shape, strict=True)
        )
        files.append((where, file))
    return _Plan(dtype, tuple(shape), tuple(chunk), files)


class _Buffers:
    """Host buffers for the arrays read, reused by later reads once nothing refers to them.

    A fresh buffer costs a page fault per page on first touch (on a 2-core VM, faulting a
    50M model's 196 MiB took 0.3-0.5 s, against 0.05 s to read it from the page cache). A
    buffer is free when the pool's own reference is its only one: every NumPy view of it,
    and a JAX CPU array aliasing it, holds a reference to it. At most `keep` bytes of free
    buffers are kept: one checkpoint's worth beyond what is in use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._raw: list[np.ndarray] = []

    @staticmethod
    def _free(raw: np.ndarray) -> bool:
        # Free: referred to by the list, the caller's loop variable, this function's argument
        # and getrefcount's own argument only (tests/unit/test_zarr_read.py holds it to that).
        return sys.getrefcount(raw) <= 4

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-order array whose data starts on a 64-byte boundary, which a
        JAX CPU device takes without a copy (`device_put` aliases it)."""
        size = math.prod(shape) * dtype.itemsize
        with self._lock:
            found = next(
                (raw for raw in self._raw if raw.size == size + _ALIGN and self._free(raw)), None
            )
            if found is None:
                found = np.empty(size + _ALIGN, np.uint8)
                self._raw.append(found)
            start = -found.ctypes.data % _ALIGN
            return found[start : start + size].view(dtype).reshape(shape)

    def trim(self, keep: int) -> None:
        """Forget free buffers beyond `keep` bytes (the most recently used are kept)."""
        with self._lock:
            kept, spare = [], 0
            for raw in reversed(self._raw):
                if not self._free(raw):
                    kept.append(raw)
                elif spare + raw.size <= keep:
                    kept.append(raw)
                    spare += raw.size
            self._raw = kept[::-1]


_BUFFERS = _Buffers()


def host_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised, 64-byte aligned C-order host array from the buffers `read_arrays`
    reads into (one freed since is reused rather than faulted in afresh)."""
    return _BUFFERS.take(tuple(shape), np.dtype(dtype))


def _read_hashed(file: Path, into: memoryview, *, hashed: bool = True) -> str | None:
    """Fill `into` with `file`'s bytes (exactly as many) and return their sha256 (None
    unless `hashed`)."""
    h = hashlib.sha256() if hashed else None
    with file.open("rb", buffering=0) as f:
        done = 0
        while done < len(into):
            got = f.readinto(into[done : done + _BLOCK])
            if not got:
                raise CheckpointError(f"{file} ended after {done} of {len(into)} bytes")
            if h is not None:
                h.update(into[done : done + got])
            done += got
    return None if h is None else h.hexdigest()


def read_arrays(params_dir: Path, layout: dict | None) -> dict[str, np.ndarray] | None:
    """Every array under `params_dir` by its directory name (Orbax's dotted parameter
    name), as host arrays of the stored dtype, or None when any of them is laid out
    otherwise than `save_params` writes. `layout` (`integrity.check_layout` of the
    checkpoint directory above `params_dir`, or None: nothing to verify) has every file
    checked: the chunk files by the hash of the bytes read, the rest hashed apart, except
    those unchanged since their manifest hashed them (`integrity`), whose identity is checked
    again once read. Raises CheckpointError on a mismatch; nothing read is returned unless
    all files match."""
    names = sorted(d.name for d in params_dir.iterdir() if (d / ZARRAY).is_file())
    plans = {name: _plan(params_dir / name) for name in names}
    if not plans or any(p is None for p in plans.values()):
        return None
    root = None if layout is None else layout["where"].absolute()
    rel = {
        file: file.absolute().relative_to(root).as_posix() if root else None
        for plan in plans.values()
        for _, file in plan.files
    }
    unchanged = set() if layout is None else layout["unchanged"]
    out, jobs = {}, []
    for name, plan in plans.items():
        out[name] = _BUFFERS.take(plan.shape, plan.dtype)
        whole = plan.chunk == plan.shape
        jobs += [(name, where, file, whole) for where, file in plan.files]

    def read(job) -> tuple[Path, str | None]:
        name, where, file, whole = job
        # Nothing to verify, or the very bytes hashed when the manifest was written.
        hashed = layout is not None and rel[file] not in unchanged
        if whole:  # the chunk is the array: read straight into it
            into = memoryview(out[name].reshape(-1).view(np.uint8))
            return file, _read_hashed(file, into, hashed=hashed)
        buf = np.empty(plans[name].chunk, out[name].dtype)
        digest = _read_hashed(file, memoryview(buf.reshape(-1).view(np.uint8)), hashed=hashed)
        out[name][where] = buf[tuple(slice(0, s.stop - s.start) for s in where)]
        return file, digest

    workers = min(len(jobs), os.cpu_count() or 1, 16)  # readinto and sha256 drop the GIL
    with ThreadPoolExecutor(workers, thread_name_prefix="zarr-read") as pool:
        digests = dict(pool.map(read, jobs))
    if layout is not None:
        known = {rel[file]: d for file, d in digests.items() if d is not None}
        verify_contents(layout["where"], layout, known=known)
        still_unchanged(layout, [rel[f] for f, d in digests.items() if d is None])
    _BUFFERS.trim(keep=sum(a.nbytes + _ALIGN for a in out.values()))
    return out


def nested(params_dir: Path, arrays: dict[str, np.ndarray]) -> dict | None:
    """`arrays` (by dotted name) as the nested dict of the tree Orbax saved, from its tree
    metadata (`_METADATA`); None when that is unreadable or names other arrays."""
    try:
        tree = json.loads((params_dir / "_METADATA").read_text())["tree_metadata"]
        paths = [[str(k["key"]) for k in entry["key_metadata"]] for entry in tree.values()]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if sorted(".".join(p) for p in paths) != sorted(arrays):
        return None
    out: dict = {}
    for path in paths:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = arrays[".".join(path)]
    return out
