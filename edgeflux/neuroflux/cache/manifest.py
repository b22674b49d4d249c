"""A cache directory's manifest and the checks made before anything in it is read: completeness,
format version, producer (staleness), and each shard file's size and sha256 (integrity).

No torch here: these checks read JSON and bytes only, so the prefetch thread can run them.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..options import STORAGES

__all__ = ["FORMAT", "MANIFEST", "VERSION", "CacheCorruptError", "CacheNotFoundError", "CacheStaleError",
           "cache_hash", "fix_hint", "is_complete", "load_manifest", "read_verified", "shard_name"]

FORMAT = "edgeflux-activation-cache"
VERSION = 1
MANIFEST = "manifest.json"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.pt"


def fix_hint(directory: Path) -> str:
    return f"delete {directory} and rerun; edgeflux rebuilds it"


class CacheCorruptError(RuntimeError):
    """A shard (or the manifest) does not match what the manifest recorded: size, sha256 or content."""

    def __init__(self, path: Path, problem: str, expected: Any = None, actual: Any = None) -> None:
        self.path, self.expected, self.actual = Path(path), expected, actual
        detail = f" (expected {expected}, found {actual})" if expected is not None or actual is not None else ""
        super().__init__(f"activation cache file {path}: {problem}{detail}; {fix_hint(Path(path).parent)}")


class CacheNotFoundError(FileNotFoundError):
    """No complete cache in the directory: it is missing, or its writer never finished (no manifest)."""


class CacheStaleError(ValueError):
    """The cache was produced by something else (another block config, weights or input) than asked for."""


def cache_hash(manifest: dict) -> str:
    """Identity of a cache's content: its producer plus every shard's sha256 (for the next block's producer)."""
    ident = {"format": manifest["format"], "version": manifest["version"], "producer": manifest["producer"],
             "shards": [s["sha256"] for s in manifest["shards"]]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def load_manifest(directory: Path) -> dict:
    """The manifest of a complete cache in this edgeflux's format version, else the error that says why not."""
    path = directory / MANIFEST
    if not path.exists():
        if directory.is_dir() and any(directory.glob("shard-*.pt")):
            raise CacheNotFoundError(f"activation cache {directory} is incomplete (shards but no {MANIFEST}: its "
                                     f"writer was interrupted); {fix_hint(directory)}")
        raise CacheNotFoundError(f"no activation cache at {directory} (no {MANIFEST}); run the block that writes it")
    try:
        manifest = json.loads(path.read_text())
        ok = manifest.get("format") == FORMAT and manifest.get("storage") in STORAGES and "shards" in manifest
    except (ValueError, AttributeError) as exc:
        raise CacheCorruptError(path, f"unreadable manifest ({exc})") from exc
    if not ok:
        raise CacheCorruptError(path, "not an edgeflux activation-cache manifest")
    if manifest["version"] != VERSION:
        raise CacheStaleError(f"activation cache {directory} has format version {manifest['version']}, this "
                              f"edgeflux reads version {VERSION}; {fix_hint(directory)}")
    return manifest


def is_complete(directory: str | Path, producer: str) -> bool:
    """Cheap check (no hashing): manifest present, same producer, every shard file there at its recorded size."""
    directory = Path(directory)
    try:
        manifest = load_manifest(directory)
    except (CacheNotFoundError, CacheCorruptError, CacheStaleError):
        return False
    if manifest["producer"] != producer:
        return False
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            return False
    return True


def read_verified(directory: Path, shard: dict) -> bytes:
    """A shard's file (``shard``: its manifest entry) after checking its size and sha256; CacheCorruptError if not."""
    path = directory / shard["file"]
    if not path.is_file():
        raise CacheCorruptError(path, "shard file missing")
    size = path.stat().st_size
    if size != shard["bytes"]:
        raise CacheCorruptError(path, "wrong size in bytes", shard["bytes"], size)
    data = path.read_bytes()
    if len(data) != shard["bytes"]:   # changed between stat and read
        raise CacheCorruptError(path, "wrong size in bytes", shard["bytes"], len(data))
    digest = hashlib.sha256(data).hexdigest()
    if digest != shard["sha256"]:
        raise CacheCorruptError(path, "sha256 mismatch", shard["sha256"], digest)
    return data
