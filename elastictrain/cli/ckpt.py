"""`elastictrain ckpt ls|verify|prune|export URL`: operator commands on a checkpoint root.

Every command takes the checkpoint root URL the job writes to (`checkpoint.url`: a path, file://, s3://bucket/prefix
or another fsspec protocol). For s3 the endpoint and credentials come from `--storage-option` first, then from the
standard AWS environment variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION).

`ckpt ls` also shows the in-memory snapshot tier on the node it runs on (cli/ckpt_snapshots.py): the job's
snapshots when there are any, every run folder with `--snapshots`.

Exit codes: 0 success; 1 `verify` found a torn or corrupt checkpoint; 2 usage, storage or checkpoint error
(one line on stderr, `elastictrain: error: ...`, printed by cli.main).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from elastictrain.checkpoint import blobs as blob_store
from elastictrain.checkpoint.discovery import CheckpointInfo, list_checkpoints, verify_files
from elastictrain.checkpoint.manifest import MARKER_NAME, parse_step_dir, sha256_stream
from elastictrain.checkpoint.retention import plan_retention
from elastictrain.checkpoint.snapshot_folders import snapshot_base
from elastictrain.checkpoint.storage import Storage, explain_storage_error, open_storage
from elastictrain.cli.ckpt_snapshots import root_key, snapshot_tier
from elastictrain.errors import CheckpointError, ElastictrainError, StorageError

log = logging.getLogger(__name__)

T = TypeVar("T")

EXIT_PROBLEMS = 1
"""`verify` found torn or corrupt checkpoints (2 stays reserved for errors, so scripts can tell them apart)."""

# botocore retries an unreachable endpoint for ~12 s by default; an operator command should fail in ~2 s.
# Applied only where the user set nothing (`--storage-option config_kwargs.retries.max_attempts=5` overrides).
_S3_CLI_DEFAULTS: dict[str, Any] = {"config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 10}}


# ---------------------------------------------------------------------------------------------- helpers


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """`k=v` pairs into fsspec options; dotted keys nest (`client_kwargs.region_name=us-east-1`).

    Values stay strings (access keys may look like numbers), except true/false and integers under
    `config_kwargs` (botocore wants ints for retries and timeouts).
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise StorageError(f"--storage-option {pair!r}: expected KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        elif key.startswith("config_kwargs.") and raw.isdigit():
            value = int(raw)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise StorageError(f"--storage-option {pair!r}: {part!r} was already given a plain value")
            node = child
        node[parts[-1]] = value
    return out


def _merge_defaults(opts: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out = dict(opts)
    for k, v in defaults.items():
        if isinstance(v, dict) and isinstance(out.get(k, {}), dict):
            out[k] = _merge_defaults(out.get(k, {}), v)
        else:
            out.setdefault(k, v)
    return out


def open_root(url: str, option_pairs: list[str]) -> Storage:
    """The `Storage` of a checkpoint root given on the command line."""
    opts = parse_storage_options(option_pairs)
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if scheme in ("s3", "s3a"):
        if not url.split("://", 1)[1].strip("/"):
            raise StorageError(f"{url!r} names no bucket; use s3://BUCKET/PREFIX")
        opts = _merge_defaults(opts, _S3_CLI_DEFAULTS)
    return open_storage(url, opts)


def _guarded(storage: Storage, action: str, fn: Callable[[], T]) -> T:
    """Run a storage operation; filesystem errors become one StorageError naming the URL and the fix."""
    try:
        return fn()
    except ElastictrainError:
        raise
    except Exception as e:  # each fsspec protocol raises its own types (botocore, aiohttp, OSError...)
        raise explain_storage_error(e, storage, action) from None


def _bucket_missing(storage: Storage) -> bool:
    if storage.protocol not in ("s3", "s3a"):
        return False
    bucket = storage.root.split("/", 1)[0]
    try:
        storage.fs.invalidate_cache()
        return not storage.fs.exists(bucket)
    except Exception:  # the listing worked a moment ago; a failing probe is not worth a second error
        return False


def load_checkpoints(storage: Storage) -> list[CheckpointInfo]:
    """Every checkpoint under the root, newest first; CheckpointError when there is none."""
    files = _guarded(storage, "list", storage.list_files)
    checkpoints = _guarded(storage, "read", lambda: list_checkpoints(storage, files))
    if not checkpoints:
        if _bucket_missing(storage):
            raise StorageError(f"no checkpoints at {storage.url}: bucket {storage.root.split('/', 1)[0]!r} does "
                               f"not exist at this endpoint; check the URL and --storage-option endpoint_url")
        if files and parse_step_dir(storage.root.rstrip("/").rsplit("/", 1)[-1]) is not None:
            raise CheckpointError(f"{storage.url} is one checkpoint, not a checkpoint root; pass its parent "
                                  f"(the job's checkpoint.url) and select it with --step")
        where = "the path does not exist" if storage.is_local and not _guarded(
            storage, "list", lambda: storage.fs.exists(storage.root)) else f"{len(files)} other file(s) there"
        raise CheckpointError(f"no checkpoints at {storage.url} (no step-NNNNNNNN directories; {where}); "
                              f"pass the job's checkpoint.url")
    return checkpoints


def _select(checkpoints: list[CheckpointInfo], step: Optional[int], url: str) -> list[CheckpointInfo]:
    if step is None:
        return checkpoints
    chosen = [c for c in checkpoints if c.step == step]
    if not chosen:
        have = ", ".join(str(c.step) for c in checkpoints[:10])
        raise CheckpointError(f"no checkpoint of step {step} at {url}; steps there (newest first): {have}")
    return chosen


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def human_age(seconds: float) -> str:
    s = max(0, int(seconds))
    for unit, width, sub, sub_width in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= width:
            return f"{s // width}{unit}{(s % width) // sub_width}{sub}"
    return f"{s}s"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart; the last column is not padded (it may be long)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for r in [headers, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(r[:-1], widths)] + [str(r[-1])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _json_out(obj: Any) -> None:
    _out(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------- ls


def describe(info: CheckpointInfo, now: Optional[float] = None) -> dict[str, Any]:
    """One checkpoint as JSON-able fields (what `ls --json` prints per checkpoint)."""
    md = info.manifest.metadata if info.manifest is not None else None
    now = time.time() if now is None else now
    return {
        "step": info.step, "status": info.status, "reason": info.reason or None, "url": info.url,
        "world_size": md.world_size if md else None, "bytes": info.nbytes, "files": len(info.files),
        # checkpoint.dedup: the blobs it references (shared with other checkpoints; not in `bytes`)
        "blob_bytes": sum(b.size for b in info.manifest.blobs) if info.manifest is not None else 0,
        "written_at": datetime.fromtimestamp(md.created_at, timezone.utc).isoformat(timespec="seconds")
        if md else None,
        "age_s": round(now - md.created_at, 1) if md else None,
    }


def _snapshot_table(tier: dict[str, Any], url: str) -> str:
    """The snapshot tier as a table, one row per committed snapshot (or per rank that has none)."""
    rows = []
    for f in tier["folders"]:
        agent = "-" if f["agent_pid"] is None else f"{f['agent_pid']} {'alive' if f['agent_alive'] else 'gone'}"
        for r in f["ranks"]:
            lead = [Path(f["folder"]).name, agent, str(r["rank"])]
            rows += [[*lead, str(s["step"]), str(s["world_size"] or "-"), human_bytes(s["bytes"]),
                      "" if root_key(str(s["url"])) == root_key(url) else f"job of {s['url']}"]
                     for s in r["snapshots"]] or [[*lead, "-", "-", "-", "nothing committed"]]
    head = f"in-memory snapshots on this node ({tier['base']})"
    if not rows:
        return f"{head}: none\n"
    memory = "".join(f"{Path(f['folder']).name}: holds {human_bytes(f['held_bytes'])}, planned "
                     f"{'-' if f['planned_bytes'] is None else human_bytes(f['planned_bytes'])} (its last budget "
                     f"check: own slots and a peer's replicas)\n" for f in tier["folders"])
    return f"{head}\n" + table(["FOLDER", "AGENT", "RANK", "STEP", "WORLD", "SIZE", "NOTE"], rows) + memory


def _durable(storage: Storage, tolerate_none: bool) -> tuple[list[CheckpointInfo], Optional[str]]:
    """The root's checkpoints; with `tolerate_none`, none is a note rather than an error (a job that snapshots
    every step holds snapshots well before its first durable save)."""
    try:
        return load_checkpoints(storage), None
    except StorageError:
        raise
    except CheckpointError as e:
        if not tolerate_none:
            raise
        return [], str(e)


def _cmd_ls(args: argparse.Namespace) -> int:
    storage = open_root(args.url, args.storage_option)
    base = Path(args.snapshot_base) if args.snapshot_base else snapshot_base()
    tier = snapshot_tier(base, None if args.snapshots else storage.url)
    show_tier = args.snapshots or bool(tier["folders"])
    checkpoints, note = _durable(storage, tolerate_none=show_tier)
    if args.verify:
        # A flipped byte keeps every size right: only reading the data back (what verify does) shows it.
        for c in checkpoints:
            problems = _guarded(storage, "read", lambda c=c: verify_files(storage, c)) if c.valid else []
            if problems:
                c.status, c.reason = "corrupt", "; ".join(problems)
    rows = [describe(c) for c in checkpoints]
    if args.json:
        _json_out({"url": storage.url, "checkpoints": rows, **({"note": note} if note else {}),
                   **({"snapshots": tier} if show_tier else {})})
        return 0
    body = [[str(r["step"]), r["status"], str(r["world_size"] or "-"), human_bytes(r["bytes"]),
             human_age(r["age_s"]) if r["age_s"] is not None else "-",
             (r["written_at"] or "-").replace("+00:00", "Z"), str(r["files"]), r["reason"] or ""] for r in rows]
    if note:
        _out(f"{storage.url}: {note}\n")
    else:
        _out(f"{storage.url}\n")
        _out(table(["STEP", "STATUS", "WORLD", "SIZE", "AGE", "WRITTEN (UTC)", "FILES", "NOTE"], body))
    if show_tier:
        _out("\n" + _snapshot_table(tier, storage.url))
    return 0


# ---------------------------------------------------------------------------------------------- verify


@dataclass
class FileProblem:
    file: str
    problem: str
    expected_size: Optional[int] = None
    actual_size: Optional[int] = None
    expected_sha256: Optional[str] = None
    actual_sha256: Optional[str] = None

    def line(self) -> str:
        if self.expected_sha256 and self.actual_sha256 and self.expected_sha256 != self.actual_sha256:
            return (f"{self.file}: sha256 mismatch: expected {self.expected_sha256}, actual {self.actual_sha256} "
                    f"({self.actual_size} bytes)")
        if self.expected_size is not None and self.actual_size is not None and self.expected_size != self.actual_size:
            return f"{self.file}: size mismatch: expected {self.expected_size} bytes, actual {self.actual_size}"
        return f"{self.file}: {self.problem}"


def _detail(storage: Storage, info: CheckpointInfo, problem: str) -> FileProblem:
    """Expected (manifest) vs actual (re-read) for one problem reported by `verify_files`."""
    assert info.manifest is not None
    entry = next((e for e in info.manifest.files if problem.startswith(e.name + ":")), None)
    blob = next((b for b in info.manifest.blobs if problem.startswith(b.name + ":")), None)
    if blob is not None:  # a referenced blob (checkpoint.dedup): named from the root, it may be shared
        return FileProblem(file=blob.name, problem=problem.split(": ", 1)[-1], expected_size=blob.size)
    if entry is None:
        return FileProblem(file=info.dirname, problem=problem)
    fp = FileProblem(file=f"{info.dirname}/{entry.name}", problem=problem.split(": ", 1)[-1],
                     expected_size=entry.size, expected_sha256=entry.sha256)
    # verify_files reports only a verdict; re-reading just the bad files gives the operator the actual values.
    try:
        with storage.fs.open(storage.path(info.dirname, entry.name), "rb") as f:
            fp.actual_size, fp.actual_sha256 = sha256_stream(f)
    except FileNotFoundError:
        fp.problem = "missing"
    return fp


def verify_one(storage: Storage, info: CheckpointInfo) -> dict[str, Any]:
    """Full checksum verification of one checkpoint: its status after reading every file back."""
    t0 = time.monotonic()
    problems: list[FileProblem] = []
    status = info.status
    if info.valid:
        found = _guarded(storage, "read", lambda: verify_files(storage, info))
        problems = [_guarded(storage, "read", lambda p=p: _detail(storage, info, p)) for p in found]
        if problems:
            status = "corrupt"
    else:
        problems = [FileProblem(file=info.dirname, problem=info.reason)]
    return {"step": info.step, "url": info.url, "status": status, "bytes": info.nbytes,
            "seconds": round(time.monotonic() - t0, 3),
            "problems": [dict(p.__dict__, message=p.line()) for p in problems]}


def _cmd_verify(args: argparse.Namespace) -> int:
    storage = open_root(args.url, args.storage_option)
    chosen = _select(load_checkpoints(storage), args.step, storage.url)
    results = []
    for info in chosen:
        r = verify_one(storage, info)
        results.append(r)
        if not args.json:
            mark = "ok" if r["status"] == "valid" else r["status"].upper()
            _out(f"step {r['step']:>8}  {mark:<7}  {human_bytes(r['bytes']):>10}  {r['url']}\n")
            for p in r["problems"]:
                _out(f"    {p['message']}\n")
    bad = [r for r in results if r["status"] != "valid"]
    if args.json:
        _json_out({"url": storage.url, "ok": not bad, "checkpoints": results})
    else:
        _out(f"{len(results) - len(bad)} of {len(results)} checkpoint(s) valid"
             + (f"; bad: {', '.join(str(r['step']) for r in bad)}\n" if bad else "\n"))
    return EXIT_PROBLEMS if bad else 0


# ---------------------------------------------------------------------------------------------- prune


def _why(info: CheckpointInfo, keep_last: int) -> str:
    return f"valid, beyond --keep-last {keep_last}" if info.valid else f"{info.status}: {info.reason}"


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise CheckpointError("refusing to delete checkpoints without confirmation: stdin is not a terminal; "
                              "pass --yes to delete, or --dry-run to only list")
    _out(f"{question} [y/N] ")
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def delete_checkpoint(storage: Storage, info: CheckpointInfo) -> None:
    """Delete one checkpoint directory, its commit marker first so a half-deleted one reads as torn."""
    try:
        storage.fs.rm(storage.path(info.dirname, MARKER_NAME))
    except FileNotFoundError:
        pass
    storage.remove_dir(info.dirname)


def _cmd_prune(args: argparse.Namespace) -> int:
    if args.keep_last < 1:
        raise CheckpointError(f"--keep-last {args.keep_last}: must be >= 1 (the newest valid checkpoint is "
                              f"never deleted)")
    if args.keep_every < 0:
        raise CheckpointError(f"--keep-every {args.keep_every}: must be >= 0 (0: off)")
    storage = open_root(args.url, args.storage_option)
    checkpoints = load_checkpoints(storage)
    doomed = plan_retention(checkpoints, args.keep_last, args.keep_every)
    doomed_dirs = {c.dirname for c in doomed}
    kept = [c for c in checkpoints if c.dirname not in doomed_dirs]
    total = sum(c.nbytes for c in doomed)
    verb = "would delete" if args.dry_run else "will delete"
    _out(f"{storage.url}: keeping {len(kept)} ({', '.join(str(c.step) for c in kept) or 'none'}), "
         f"{verb} {len(doomed)} ({human_bytes(total)})\n")
    for c in doomed:
        _out(f"  {verb} step {c.step}  {human_bytes(c.nbytes)}  {_why(c, args.keep_last)}\n")
    if not doomed or args.dry_run:
        return 0
    if not args.yes and not _confirm(f"Delete {len(doomed)} checkpoint(s), {human_bytes(total)}?"):
        _out("nothing deleted\n")
        return 0
    # Delete exactly what was shown (not a fresh plan): a job saving meanwhile must not widen what the
    # operator agreed to.
    for c in doomed:
        _guarded(storage, "delete from", lambda c=c: delete_checkpoint(storage, c))
        log.info("ckpt prune: deleted %s (%s)", c.url, _why(c, args.keep_last))
        _out(f"deleted {c.url}\n")
    # Blobs (checkpoint.dedup): only those the deleted checkpoints referenced and no kept one does. Not every
    # unreferenced blob: a job saving meanwhile may have written blobs its uncommitted checkpoint will reference
    # (the job's own retention collects leftovers between its saves).
    orphans = blob_store.referenced(c.manifest for c in doomed) - blob_store.referenced(c.manifest for c in kept)
    if orphans:
        files = {n: s for n, s in _guarded(storage, "list", storage.list_files).items() if n in orphans}
        gone = _guarded(storage, "delete from", lambda: blob_store.collect(storage, set(files) - orphans, files))
        _out(f"deleted {len(gone)} blob(s) only the deleted checkpoints referenced\n")
    return 0


# ---------------------------------------------------------------------------------------------- export


def _cmd_export(args: argparse.Namespace) -> int:
    # Imported here: torch and transformers cost seconds, and ls/verify/prune need neither.
    import torch

    from elastictrain.checkpoint.export_peft import export_checkpoint

    storage = open_root(args.url, args.storage_option)
    checkpoints = load_checkpoints(storage)
    if args.step is None:
        valid = [c for c in checkpoints if c.valid]
        if not valid:
            raise CheckpointError(f"no valid checkpoint at {storage.url} to export "
                                  f"({len(checkpoints)} torn or corrupt); see `elastictrain ckpt ls`")
        info = valid[0]
    else:
        info = _select(checkpoints, args.step, storage.url)[0]
        if not info.valid:
            raise CheckpointError(f"checkpoint of step {info.step} at {info.url} is {info.status} "
                                  f"({info.reason}); export another step")
    if not args.no_verify:
        problems = _guarded(storage, "read", lambda: verify_files(storage, info))
        if problems:
            raise CheckpointError(f"checkpoint {info.url} is corrupt: {'; '.join(problems)}; export another step "
                                  f"or pass --no-verify")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    written = _guarded(storage, "read", lambda: export_checkpoint(storage, info, args.out, merged=args.merged,
                                                                  base=args.base, dtype=dtype))
    _out(f"exported step {info.step} from {info.url} to {args.out}\n")
    for path in written:
        _out(f"  {path}\n")
    return 0


# ---------------------------------------------------------------------------------------------- parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="checkpoint root: a path, file:///path, s3://bucket/prefix")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec/s3fs option, e.g. endpoint_url=http://127.0.0.1:9000, key=..., secret=..., "
                        "client_kwargs.region_name=... (repeatable; AWS_* environment variables fill the rest)")


def register(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add `ckpt ls|verify|prune|export` to the `elastictrain` parser; returns ckpt's subparsers (for `now`)."""
    p = sub.add_parser("ckpt", help="list, verify, prune and export checkpoints",
                       description="Operate on the checkpoints under a checkpoint root (the job's checkpoint.url).")
    csub = p.add_subparsers(dest="ckpt_command", required=True, metavar="{ls,verify,prune,export,now}")

    ls = csub.add_parser("ls", help="list checkpoints, newest first (one listing, no checksum reads), and the "
                                    "job's in-memory snapshots on this node",
                         description="One listing plus the small marker and manifest of each committed checkpoint: "
                                     "missing and truncated files show; a flipped byte needs --verify (or verify). "
                                     "Then the job's in-memory snapshots on this node, if any (their commit "
                                     "markers: rank, step, size, and whether the owning agent is alive).")
    _common(ls)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument("--verify", action="store_true",
                    help="also read every file back and mark checksum mismatches corrupt (reads all the data)")
    ls.add_argument("--snapshots", action="store_true",
                    help="show every in-memory snapshot folder on this node, of any job, even when there is none "
                         "(by default the job's snapshots show when this node holds some)")
    ls.add_argument("--snapshot-base", default=None, metavar="DIR",
                    help="where this node's agents keep their snapshot folders (default: "
                         "/dev/shm/elastictrain-snapshots-<uid>)")
    ls.set_defaults(func=_cmd_ls)

    v = csub.add_parser("verify", help="read every file back and check it against the manifest's sha256",
                        description="Exit 0 when every checked checkpoint is valid, 1 when one is torn or corrupt.")
    _common(v)
    v.add_argument("--step", type=int, default=None, help="verify only this step (default: all)")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=_cmd_verify)

    pr = csub.add_parser("prune", help="delete checkpoints by retention rules",
                         description="Keep the newest --keep-last valid checkpoints (and every --keep-every-th "
                                     "step); delete older ones and torn/corrupt leftovers older than the newest "
                                     "valid one. The newest valid checkpoint is never deleted.")
    _common(pr)
    pr.add_argument("--keep-last", type=int, required=True, metavar="N", help="valid checkpoints to keep (>= 1)")
    pr.add_argument("--keep-every", type=int, default=0, metavar="M",
                    help="also keep every valid checkpoint whose step is a multiple of M")
    pr.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    pr.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    pr.set_defaults(func=_cmd_prune)

    ex = csub.add_parser("export", help="write a consolidated Hugging Face checkpoint (model.safetensors + "
                                        "config.json), or a LoRA adapter in PEFT's format",
                         description="A full checkpoint becomes a transformers directory. A LoRA checkpoint "
                                     "(model.lora) becomes a PEFT adapter directory (adapter_config.json + "
                                     "adapter_model.safetensors, for PeftModel.from_pretrained), or with --merged "
                                     "the base with the adapter merged in. A model.freeze checkpoint needs "
                                     "--merged: it holds only the trained tensors.")
    _common(ex)
    ex.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    ex.add_argument("--step", type=int, default=None, help="step to export (default: newest valid)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="cast floating-point weights (default: as saved)")
    ex.add_argument("--no-verify", action="store_true", help="skip the checksum verification before export")
    ex.add_argument("--merged", action="store_true",
                    help="LoRA / frozen-layer checkpoints: write the complete model, the trained tensors merged into "
                         "the pretrained base")
    ex.add_argument("--base", default=None, metavar="DIR",
                    help="with --merged: the pretrained base directory (default: the model.path the job read; it "
                         "must hold the same weights)")
    ex.set_defaults(func=_cmd_export)
    return csub
