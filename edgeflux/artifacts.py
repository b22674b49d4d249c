"""Files the stages hand to each other: trained models and JSON metrics, written atomically and checked.

A model file holds its zoo spec next to the weights, so ``load_model`` rebuilds it without the
params that made it (a device downloading a pre-trained backbone needs only the file).

Every torch file edgeflux writes and reads back (models, checkpoints, prepared data) is a dict that
carries ``content_sha256``, a digest of everything else in it: tensors by dtype, shape and bytes,
the rest by value. ``load_checked`` recomputes it, so a flipped bit anywhere that matters is an
error naming the file and the fix, not a silently different model. The digest is over the content
rather than the file's bytes so that the file stays a plain ``torch.load``-able dict (one key more)
and ``mmap`` loading still works. JSON that a later stage reads back carries the same key, a
digest of its canonical text (``write_json(..., checksum=True)``).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgeflux.errors import UserError
from edgeflux.models import build_model


def atomic_write(path: str | Path, write) -> None:
    """write(tmp_path), then rename over path: a kill mid-write leaves the old file (or none), never half a file.

    The temporary file is fsync'd before the rename and the directory after it: without that, a power
    cut on a device (an SD card, ext4's delayed allocation) can leave the new name pointing at an empty
    file, and a record or manifest that vouches for bytes that never reached the disk.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        _fsync(tmp)
    except (OSError, RuntimeError) as exc:   # torch.save reports a failed write as a RuntimeError
        tmp.unlink(missing_ok=True)           # nothing half-written stays; the previous file is untouched
        raise WriteError(path, exc) from None
    os.replace(tmp, path)
    _fsync(path.parent)


class WriteError(OSError, UserError):
    """A file could not be written (disk full, read-only, no permission): one line naming the file and the fix."""

    def __init__(self, path: Path, cause: Exception) -> None:
        reason = _first_line(cause)
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        errno_ = getattr(cause, "errno", None)
        if errno_ in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < 1 << 20):
            fix = f"the disk is full ({free or 0} bytes free on {path.parent}): free space and rerun"
        elif errno_ in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = f"{path.parent} is not writable: make it writable (or run from a writable copy) and rerun"
        else:
            fix = "check the disk and rerun"
        super().__init__(errno_, f"could not write {path} ({reason}); {fix}; the previous {path.name}, if any, "
                                 f"is untouched")
        self.filename = str(path)

    def __str__(self) -> str:
        return self.strerror


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:   # some file systems (and Windows) cannot open or sync a directory: the rename still holds
        if not path.is_dir():
            raise


CHECKSUM_KEY = "content_sha256"


class CorruptFileError(ValueError, UserError):
    """A file a stage reads is damaged: not valid JSON or torch data, or not what its checksum vouches for."""


def hash_tensor(h, t: torch.Tensor) -> None:
    """Feed a tensor's dtype, shape and bytes to h (in place: a contiguous CPU tensor is not copied)."""
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{list(t.shape)};".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)


def content_digest(obj: Any) -> str:
    """sha256 of a nest of dicts, lists, tensors and plain values, as they are after a save/load round trip."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        hash_tensor(h, obj)
    elif isinstance(obj, Mapping):   # in insertion order: pickling keeps it, and key order is content too
        h.update(f"{{{len(obj)};".encode())
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"[{len(obj)};".encode())
        for value in obj:
            _feed(h, value)
    elif obj is None or isinstance(obj, (str, bytes, bool, int, float)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())   # repr: floats round-trip exactly
    else:   # an object we cannot hash by value would make the checksum depend on its memory address
        raise TypeError(f"content_digest: cannot checksum a {type(obj).__name__}")


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes: what a run started from, for its checkpoint's signature."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_checked(path: str | Path, state: dict) -> None:
    """torch.save state plus its content checksum, atomically."""
    save_torch(path, {**state, CHECKSUM_KEY: content_digest(state)})


def save_torch(path: str | Path, obj: Any) -> None:
    """torch.save, atomically, through a Python file: a full disk is then an OSError with its errno
    (torch's own writer reports it as an 'unexpected pos' RuntimeError)."""
    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            torch.save(obj, f)
    atomic_write(Path(path), write)


def load_checked(path: str | Path, fix: str, **load_kwargs) -> dict:
    """What save_checked wrote, its checksum verified; CorruptFileError naming the file and `fix` otherwise.

    load_kwargs go to torch.load (weights_only, mmap); tensors are loaded to the CPU."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", **load_kwargs)
    except Exception as exc:   # zip, pickle and storage errors of a truncated or damaged file all mean the same
        raise CorruptFileError(f"{path} is corrupt or truncated ({_first_line(exc)}): {fix}") from None
    if not isinstance(state, dict) or CHECKSUM_KEY not in state:
        raise CorruptFileError(f"{path} carries no edgeflux checksum (written by another tool or an older "
                               f"edgeflux): {fix}")
    expected = state.pop(CHECKSUM_KEY)
    if content_digest(state) != expected:
        raise CorruptFileError(f"{path} is corrupt (its content does not match its checksum): {fix}")
    return state


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def write_json(path: str | Path, data: Any, checksum: bool = False) -> None:
    """Indented, sorted JSON, atomically; checksum: add CHECKSUM_KEY (a file read_json(checksum=True) reads)."""
    if checksum:
        data = {**data, CHECKSUM_KEY: _json_digest(data)}
    atomic_write(Path(path), lambda p: p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n"))


def _json_digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def read_json(path: str | Path, missing: str, checksum: bool = False) -> Any:
    """The JSON in `path`; FileNotFoundError saying `missing` (what makes the file) when it is absent,
    CorruptFileError saying the same when it is not valid JSON or (checksum) does not match its checksum."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {missing}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptFileError(f"{path} is not valid JSON ({exc}); remake it: {missing}") from None
    if checksum:
        expected = data.pop(CHECKSUM_KEY, None) if isinstance(data, dict) else None
        if expected is None:
            raise CorruptFileError(f"{path} carries no edgeflux checksum (written by hand or an older edgeflux); "
                                   f"remake it: {missing}")
        if expected != _json_digest(data):
            raise CorruptFileError(f"{path} does not match its checksum (edited or damaged); remake it: {missing}")
    return data


def save_model(path: str | Path, model: nn.Module, spec: dict, meta: dict | None = None) -> None:
    """``spec``: build_model keyword arguments (name, num_classes, in_channels, width, ...)."""
    save_checked(path, {"spec": spec, "state_dict": model.state_dict(), "meta": meta or {}})


def model_fix(path: str | Path, stage: str = "<the stage that writes it>") -> str:
    """What to do about a damaged output model: DVC's cache holds the last good copy of every output."""
    return f"restore the last good copy with `dvc checkout --force {path}`, or remake it with `dvc repro --force {stage}`"


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """Rebuild a model saved by ``save_model``; returns (model, meta). The build_model arguments it was saved with
    are ``model.build_args``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file; run the stage that writes it (see dvc.yaml: `dvc repro`)")
    state = load_checked(path, model_fix(path), weights_only=True)
    model = build_model(**state["spec"])
    model.load_state_dict(state["state_dict"])
    model.build_args = dict(state["spec"])
    return model.to(map_location), state["meta"]
