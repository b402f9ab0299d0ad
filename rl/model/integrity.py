"""Checkpoint integrity: a manifest of every file (size + sha256) written once a checkpoint is
complete, verified before anything read from it is used, and a finiteness check of loaded
arrays.

    write_manifest(path)          # after the writer (Orbax) has committed `path`
    verify_checkpoint(path)       # raises CheckpointError naming the first problem
    layout = check_layout(path)   # or in two halves: layout first, then hash while reading
    verify_contents(path, layout)
    nonfinite_leaves(params)      # ["layers/mlp/up", ...]: leaves holding NaN or inf

A checkpoint is a directory; its manifest `manifest.json` lists each regular file under it.
Verification refuses a missing or torn manifest, a missing, resized, altered or unlisted file,
and any symlink or path that resolves outside the directory (a checkpoint is confined to
itself). Trainers (`rl.train.checkpoint`, `Trainer.export_serving`) write manifests; trainer
resume and servers reloading weights verify them.

Verified once per machine: the manifest also records each file's identity when it was
hashed (this boot of the kernel, device, inode, size, mtime and ctime). A reader on the same
running machine that finds a file with that identity reads what was hashed, from the same
page cache, and skips re-hashing it: any write to the file since moves its ctime, which no
user can set back, and a replaced file is another inode. Co-located servers loading each
published version then do not hash it again, each of them (a 50M model: 0.1 cpu-s per
server). Identity is recorded only for a file whose ctime is older than the filesystem's own
timestamp when its hashing began, so a later write cannot leave the ctime as it was, however
coarse the filesystem's clock. `SIMLOOP_VERIFY_HASHES=always`
hashes every file regardless (e.g. against a disk that may rot under an evicted page cache).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint is incomplete, altered, escapes its directory, or holds non-finite
    values; the message names the checkpoint and what is wrong with it."""


class ManifestMissing(CheckpointError):
    """The checkpoint has no manifest: its save was interrupted before sealing, or another
    tool wrote it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sha256_all(files: dict[str, Path]) -> dict[str, str]:
    """Each file's sha256, several files at once (hashlib releases the GIL on large updates:
    a checkpoint's few big files hash on as many cores as there are files)."""
    if len(files) < 2:
        return {rel: _sha256(p) for rel, p in files.items()}
    workers = min(len(files), os.cpu_count() or 1, 16)
    with ThreadPoolExecutor(workers, thread_name_prefix="sha256") as pool:
        return dict(zip(files, pool.map(_sha256, files.values()), strict=True))


def _files(root: Path) -> dict[str, Path]:
    """Every file under `root` by its relative POSIX path (the manifest excluded); a symlink,
    or anything but a regular file or a directory, is a CheckpointError."""
    out: dict[str, Path] = {}
    for folder, dirs, names in os.walk(root, followlinks=False):
        for name in dirs + names:
            p = Path(folder) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise CheckpointError(f"checkpoint {root}: {rel} is a symlink (not allowed)")
            if name in names and not p.is_file():
                raise CheckpointError(f"checkpoint {root}: {rel} is not a regular file")
            if name in names and rel != MANIFEST:
                out[rel] = p
    return out


def check_confined(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> dict:
    """CheckpointError unless `path` is a real directory (inside `root` once symlinks are
    resolved, given `root`) holding only regular files and folders, no symlink; returns its
    files by relative path."""
    where = Path(path)
    if root is not None:
        real_root, real = Path(os.path.realpath(root)), Path(os.path.realpath(where))
        if not real.is_relative_to(real_root):
            raise CheckpointError(f"checkpoint {where} resolves outside {real_root}")
    if where.is_symlink() or not where.is_dir():
        raise CheckpointError(f"checkpoint {where} is not a directory")
    return _files(where)


VERIFY_ENV = "SIMLOOP_VERIFY_HASHES"
"""`always`: hash every file on every verification; unset (or `changed`): only files whose
identity differs from the one their manifest recorded."""


@functools.cache
def _boot_id() -> str | None:
    """This boot of this machine's kernel (Linux); None elsewhere: identities never match."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _identity(st: os.stat_result) -> list:
    return [_boot_id(), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def write_manifest(path: str | os.PathLike) -> Path:
    """Record every file under the checkpoint directory `path` (atomically: a torn manifest
    never verifies). Call it only once the checkpoint is completely written."""
    root = Path(path)
    present = dict(sorted(_files(root).items()))
    out = root / MANIFEST
    tmp = root / f".{MANIFEST}.tmp"
    with tmp.open("w") as f:
        # The filesystem's own clock, in its own granularity, as hashing begins: a file last
        # changed before it, and any change made later, cannot share a ctime.
        began = os.fstat(f.fileno()).st_ctime_ns
        before = {rel: p.stat() for rel, p in present.items()}
        digests = _sha256_all(present)
        files = {}
        for rel, p in present.items():
            st = p.stat()
            files[rel] = {"size": st.st_size, "sha256": digests[rel]}
            settled = max(st.st_ctime_ns, st.st_mtime_ns) < began
            if _boot_id() and settled and _identity(st) == _identity(before[rel]):
                files[rel]["identity"] = _identity(st)
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def verify_checkpoint(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> None:
    """Raise CheckpointError unless the checkpoint directory `path` is exactly what its
    manifest lists: every file present with its size and sha256, nothing else, no symlink,
    and (given `root`) the directory itself inside `root` once symlinks are resolved."""
    verify_contents(path, check_layout(path, root=root))


def check_layout(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> dict:
    """The cheap half of `verify_checkpoint`: confinement, the manifest readable, exactly its
    files present with their sizes. Returns what `verify_contents` needs to finish (hashing),
    which a reader may run while it reads the files: nothing outside `path` is touched."""
    where = Path(path)
    present = check_confined(where, root=root)
    trust = os.environ.get(VERIFY_ENV, "changed") != "always"
    unchanged: set[str] = set()
    try:
        listed = json.loads((where / MANIFEST).read_text())["files"]
        if not isinstance(listed, dict):
            raise TypeError("files is not a mapping")
    except FileNotFoundError:
        raise ManifestMissing(
            f"checkpoint {where} has no {MANIFEST} (an interrupted save, or not written by simloop)"
        ) from None
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {where}: {MANIFEST} is unreadable ({e})") from None
    for rel in sorted(set(listed) | set(present)):
        if rel not in present:
            raise CheckpointError(f"checkpoint {where}: {rel} is missing")
        if rel not in listed:
            raise CheckpointError(f"checkpoint {where}: {rel} is not in its {MANIFEST}")
        want, p = listed[rel], present[rel]
        st = p.stat()
        if not isinstance(want, dict) or st.st_size != want.get("size"):
            raise CheckpointError(
                f"checkpoint {where}: {rel} has {st.st_size} bytes, the manifest says "
                f"{want.get('size') if isinstance(want, dict) else want!r} (truncated?)"
            )
        if trust and want.get("identity") == _identity(st):
            unchanged.add(rel)
    return {"where": where, "present": present, "listed": listed, "unchanged": unchanged}


def still_unchanged(layout: dict, rels) -> None:
    """CheckpointError unless each of the files `rels` (of `layout["unchanged"]`) still has
    the identity its manifest recorded: for a reader that read them without hashing."""
    for rel in rels:
        if _identity(layout["present"][rel].stat()) != layout["listed"][rel]["identity"]:
            raise CheckpointError(f"checkpoint {layout['where']}: {rel} changed while read")


def verify_contents(path: str | os.PathLike, layout: dict, *, known: dict | None = None) -> None:
    """The expensive half of `verify_checkpoint`: every file's sha256 against its manifest,
    but those `check_layout` found unchanged since hashed. `known` holds digests a reader
    already took of the bytes it read ({relative path: sha256}); only the other files are
    hashed here."""
    known = known or {}
    skip = known.keys() | layout.get("unchanged", set())
    rest = {rel: p for rel, p in layout["present"].items() if rel not in skip}
    digests = {**_sha256_all(rest), **known}
    for rel in sorted(digests):
        if rel not in layout["listed"]:  # appeared after the layout was checked
            raise CheckpointError(f"checkpoint {layout['where']}: {rel} is not in its {MANIFEST}")
        if digests[rel] != layout["listed"][rel].get("sha256"):
            raise CheckpointError(
                f"checkpoint {layout['where']}: {rel} does not match its sha256 (corrupt)"
            )


@functools.cache
def _all_finite():
    """One jitted function over all leaves (compiled once per parameter layout, so a server
    that checked its own weights at warmup compiles nothing when it reloads)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda xs: [jnp.isfinite(x).all() for x in xs])


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths ("a/b/c") of the floating-point leaves of `tree` holding a NaN or an infinity.
    Device arrays are checked where they are (one transfer of one bool per leaf); a tree of
    host NumPy arrays on the host (a vLLM worker's read never touches its accelerator)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    flat = [
        (p, x)
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if all(isinstance(x, np.ndarray) for _, x in flat):
        finite = [bool(np.isfinite(x).all()) for _, x in flat]
    else:
        finite = _all_finite()([x for _, x in flat]) if flat else []
        # One process's copy of each replicated answer (several processes: the others hold
        # the same; `jax.device_get` refuses arrays spanning other processes' devices).
        finite = [bool(np.asarray(f.addressable_data(0))) for f in finite]
    return [
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)
        for (p, _), ok in zip(flat, finite, strict=True)
        if not ok
    ]


def check_finite(tree: Any, what: str) -> None:
    """CheckpointError naming up to five leaves of `tree` that hold NaN or inf."""
    bad = nonfinite_leaves(tree)
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise CheckpointError(f"{what} holds non-finite values (NaN/inf) in {bad[:5]}{more}")
