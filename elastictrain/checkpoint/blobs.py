"""Delta checkpoints: tensors whose bytes did not change since an earlier checkpoint are stored once, as
content-addressed blobs shared by the checkpoints that reference them (`checkpoint.dedup`).

Layout below the checkpoint root:

    blobs/<sha256>          one tensor as DCP serializes it (torch.save bytes), named by their sha256
    blobs/<sha256>.zst      the same, zstd-compressed (`checkpoint.compression: zstd`); the name is still the
                            sha256 of the *uncompressed* bytes, so a tensor is found again without compressing it
    step-00000120/__0_0.distcp   the rank's small items (non-tensor state, tensors < DEDUP_MIN_BYTES) as before
    step-00000120/manifest.json  lists the blobs the checkpoint references (`Manifest.blobs`: name, stored
                                 size, sha256 of the decoded bytes) next to its own files

Granularity: one blob per tensor item DCP writes (a rank's shard of one parameter or optimizer state), not per
rank file. A rank file mixes frozen and trained tensors (a frozen embedding sits in the same `__0_0.distcp` as the
blocks' weights and AdamW moments), so whole-file dedup saves nothing unless *everything* a rank holds is
unchanged; per tensor, every unchanged parameter is saved once whatever else changes. DCP's own metadata points
each item at `../blobs/<name>` (offset 0), so loading is DCP's ordinary read at any world size (resharding is
unchanged); `BlobReader` only normalises that relative path for object stores.

Safety: a blob is written before the checkpoint that references it is committed (atomically: a temporary name
renamed on local filesystems, one PUT on object stores), so a committed checkpoint never references a missing or
partial blob; retention deletes a blob only when no remaining checkpoint's manifest references it (`collect`), and
it runs after a commit, while no save of the job is in flight.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import uuid
from typing import Any, Iterable, Optional

from elastictrain.checkpoint.manifest import FileEntry
from elastictrain.checkpoint.storage import Storage, fsync_dir

log = logging.getLogger(__name__)

BLOB_DIR = "blobs"
ZSTD_SUFFIX = ".zst"
DEDUP_MIN_BYTES = 256 << 10
"""Default of checkpoint.dedup_min_bytes: tensors smaller than this stay in the rank's file: a blob each would
cost a file (an object-store PUT and a HEAD per save) for a few KB (LoRA matrices, norms, biases, step counters)."""


def blob_name(digest: str, compressed: bool) -> str:
    """The root-relative name of the blob of bytes whose sha256 is `digest`."""
    return f"{BLOB_DIR}/{digest}{ZSTD_SUFFIX if compressed else ''}"


def digest_of(name: str) -> str:
    """The sha256 a blob's name promises (of its decoded bytes)."""
    base = posixpath.basename(name)
    return base[:-len(ZSTD_SUFFIX)] if base.endswith(ZSTD_SUFFIX) else base


def is_blob(name: str) -> bool:
    return name.startswith(BLOB_DIR + "/")


def stored_size(storage: Storage, name: str) -> Optional[int]:
    """The size of blob `name` in storage, None when there is none (one stat / HEAD)."""
    try:
        info = storage.fs.info(storage.path(name))
    except FileNotFoundError:
        return None
    return int(info.get("size") or 0)


def write_blob(storage: Storage, name: str, data: bytes) -> None:
    """Write a blob atomically: readers see it whole or not at all."""
    p = storage.path(name)
    if storage.is_local:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        fsync_dir(os.path.dirname(p))
    else:
        storage.fs.pipe_file(p, data)  # one PUT: an object appears complete or not at all


def compress(data: bytes) -> bytes:
    """zstd, framed as torch's ZStandard stream transform writes it (so DCP's reader decodes it)."""
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def verify_blob(storage: Storage, entry: FileEntry) -> Optional[str]:
    """Re-read one blob: its stored size and the sha256 of its decoded bytes; None when sound, else the problem."""
    try:
        with storage.fs.open(storage.path(entry.name), "rb") as raw:
            size = storage.fs.info(storage.path(entry.name)).get("size")
            stream: Any = raw
            if entry.name.endswith(ZSTD_SUFFIX):
                import zstandard

                stream = zstandard.ZstdDecompressor().stream_reader(raw)
            h = hashlib.sha256()
            while True:
                b = stream.read(8 << 20)
                if not b:
                    break
                h.update(b)
    except FileNotFoundError:
        return f"{entry.name}: missing (a blob this checkpoint references)"
    except Exception as e:  # a zstd frame that does not decode is corruption too
        if type(e).__module__.startswith("zstd"):
            return f"{entry.name}: does not decompress ({e}) (corrupt)"
        raise
    if size is not None and int(size) != entry.size:
        return f"{entry.name}: {size} bytes, manifest says {entry.size}"
    if h.hexdigest() != entry.sha256:
        return f"{entry.name}: sha256 mismatch (corrupt)"
    return None


def referenced(manifests: Iterable[Any]) -> set[str]:
    """The blob names the given manifests reference."""
    return {b.name for m in manifests if m is not None for b in m.blobs}


def collect(storage: Storage, keep: set[str], files: Optional[dict[str, int]] = None) -> list[str]:
    """Delete every blob below the root that `keep` does not name (after retention deleted checkpoints)."""
    if files is None:
        files = storage.list_files()
    deleted = []
    for name in sorted(files):
        if not is_blob(name) or name in keep:
            continue
        try:
            storage.fs.rm(storage.path(name))
        except FileNotFoundError:
            continue
        deleted.append(name)
    if deleted:
        log.info("retention: deleted %d blob(s) no kept checkpoint references (%.1f MB)", len(deleted),
                 sum(files[n] for n in deleted) / 1e6)
    return deleted
