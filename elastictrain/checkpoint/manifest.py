"""What a checkpoint directory holds besides DCP's data: the manifest (files, sizes, checksums, metadata)
and the commit marker, plus the naming of checkpoint directories.

Layout of one checkpoint, `<url>/step-00000120/`:

    __0_0.distcp  __1_0.distcp ...   DCP data, one file per rank (written by each rank)
    .metadata                        DCP's global metadata (written by the coordinator)
    manifest.json                    every file above with size + sha256, and `CheckpointMetadata`; with
                                     checkpoint.dedup also the blobs (`<url>/blobs/`) it references
    COMMITTED                        the commit marker: step + sha256 of manifest.json; written last

A checkpoint is valid only when COMMITTED exists, names the sha256 of the manifest.json beside it, and
every file in the manifest exists with the listed size (and, when verified, the listed sha256).
Checksums are SHA-256 (hashlib; about 2 GB/s per core here, and no new dependency).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

MANIFEST_NAME = "manifest.json"
MARKER_NAME = "COMMITTED"
DCP_METADATA_NAME = ".metadata"
FORMAT_VERSION = 2
"""The newest manifest format this elastictrain reads: 1, plain; 2, references content-addressed blobs
(`checkpoint.dedup`, checkpoint/blobs.py). A save without blobs still writes format 1."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of `step` (zero-padded so that names sort by step)."""
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> Optional[int]:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


@functools.lru_cache(maxsize=1)
def _versions() -> tuple[tuple[str, str], ...]:
    """Versions that change how a checkpoint reads back (a difference is reported as a warning)."""
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for mod in ("transformers", "peft", "elastictrain"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod)
        except Exception:  # not installed as a distribution: not worth failing a save over
            continue
    return tuple(out.items())


def library_versions() -> dict[str, str]:
    """Versions that change how a checkpoint reads back (a difference is reported as a warning)."""
    return dict(_versions())


@dataclass
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclass
class CheckpointMetadata:
    """What the job knew when it saved; travels to the coordinator (maybe another process) and to storage."""

    step: int
    world_size: int
    fingerprint: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    """Unix time at which the save started."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON (e.g. `hf_config`, the transformers config dict used by export)."""


@dataclass
class Manifest:
    metadata: CheckpointMetadata
    files: list[FileEntry]
    format: int = 1
    blobs: list[FileEntry] = field(default_factory=list)
    """Blobs below the root (`blobs/<sha256>[.zst]`) that this checkpoint's data refers to: name, stored size,
    sha256 of the decoded bytes."""

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        raw = json.loads(data)
        return cls(metadata=CheckpointMetadata(**raw["metadata"]),
                   files=[FileEntry(**f) for f in raw["files"]], format=int(raw.get("format", 1)),
                   blobs=[FileEntry(**b) for b in raw.get("blobs", [])])

    def sizes(self) -> dict[str, int]:
        return {f.name: f.size for f in self.files}


@dataclass
class CommitMarker:
    step: int
    manifest_sha256: str

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "CommitMarker":
        raw = json.loads(data)
        return cls(step=int(raw["step"]), manifest_sha256=str(raw["manifest_sha256"]))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_stream(f: Any, chunk: int = 8 << 20) -> tuple[int, str]:
    """Size and sha256 of everything readable from a binary file object."""
    h = hashlib.sha256()
    n = 0
    while True:
        b = f.read(chunk)
        if not b:
            break
        h.update(b)
        n += len(b)
    return n, h.hexdigest()


class HashingWriter(io.RawIOBase):
    """Passes writes through to a stream while counting and hashing them (one pass, no read-back).

    On close it makes the data durable: fsync for local files, the stream's own close (the upload)
    for object stores.
    """

    def __init__(self, raw: Any, name: str, on_close: Any) -> None:
        super().__init__()
        self.raw = raw
        self.name_ = name
        self._hash = hashlib.sha256()
        self._size = 0
        self._on_close = on_close
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = self.raw.write(mv)
        written = len(mv) if n is None else n
        self._hash.update(mv[:written])
        self._size += written
        return written

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self.raw.flush()
        try:
            fd = self.raw.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
            fd = None
        if fd is not None:
            os.fsync(fd)
        super().close()
        self.raw.close()
        self._on_close(FileEntry(self.name_, self._size, self._hash.hexdigest()))
