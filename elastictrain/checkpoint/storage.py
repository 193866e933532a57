"""Checkpoint storage by URL: a path, file://, s3://bucket/prefix (s3fs), or any other fsspec protocol.

`open_storage(url, options)` resolves the URL to an fsspec filesystem once; `Storage` then speaks in
names relative to the checkpoint root. `check_storage` probes it (list + write + delete) and turns the
usual failures into a `StorageError` that names the URL and the fix; `explain_storage_error` does the
same for an error raised later, in the middle of a save.

For s3 the endpoint, credentials and region come from `storage_options` first, then from the standard
AWS environment variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_REGION / AWS_DEFAULT_REGION).
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from fsspec.core import url_to_fs

from elastictrain.errors import StorageError, StorageFullError, StorageUnreachableError

log = logging.getLogger(__name__)

_S3_PROTOCOLS = ("s3", "s3a")


def _is_local(protocol: str) -> bool:
    return protocol in ("file", "local")


def resolve_options(url: str, storage_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The fsspec options for `url`: the given ones, completed from AWS environment variables for s3."""
    opts = dict(storage_options or {})
    protocol = _protocol_of(url)
    if protocol in _S3_PROTOCOLS:
        env = os.environ
        # Written out explicitly so that what we resolved is what both s3fs and our messages use.
        if "endpoint_url" not in opts and not (opts.get("client_kwargs") or {}).get("endpoint_url"):
            if env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"):
                opts["endpoint_url"] = env.get("AWS_ENDPOINT_URL_S3") or env["AWS_ENDPOINT_URL"]
        if "key" not in opts and env.get("AWS_ACCESS_KEY_ID"):
            opts["key"] = env["AWS_ACCESS_KEY_ID"]
        if "secret" not in opts and env.get("AWS_SECRET_ACCESS_KEY"):
            opts["secret"] = env["AWS_SECRET_ACCESS_KEY"]
        if "token" not in opts and env.get("AWS_SESSION_TOKEN"):
            opts["token"] = env["AWS_SESSION_TOKEN"]
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        client_kwargs = dict(opts.get("client_kwargs") or {})
        if region and "region_name" not in client_kwargs:
            client_kwargs["region_name"] = region
        if client_kwargs:
            opts["client_kwargs"] = client_kwargs
        # botocore >= 1.36 checks a whole-object CRC against ranged GETs on S3-compatible servers that send
        # it (rclone, some MinIO versions) and fails every DCP read; our manifest's sha256 covers integrity.
        config_kwargs = dict(opts.get("config_kwargs") or {})
        config_kwargs.setdefault("response_checksum_validation", "when_required")
        config_kwargs.setdefault("request_checksum_calculation", "when_required")
        opts["config_kwargs"] = config_kwargs
    return opts


def _protocol_of(url: str) -> str:
    if "://" not in url:
        return "file"
    return url.split("://", 1)[0].lower()


def endpoint_of(options: dict[str, Any]) -> Optional[str]:
    return options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")


@dataclass
class Storage:
    """A checkpoint root on one filesystem; names below it are '/'-separated and relative to the root."""

    url: str
    """The root as given by the user (normalised: no trailing slash)."""
    fs: Any
    root: str
    """The root as a path on `fs` (no protocol; for s3: bucket/prefix)."""
    protocol: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return _is_local(self.protocol)

    def path(self, *names: str) -> str:
        """The `fs` path of a name below the root."""
        return posixpath.join(self.root, *names) if names else self.root

    def url_for(self, *names: str) -> str:
        """The full URL of a name below the root (what DCP's fsspec writer and reader take)."""
        if not names:
            return self.url
        return self.url.rstrip("/") + "/" + "/".join(names)

    def relative(self, fs_path: str) -> str:
        """The name of an `fs` path below the root."""
        root = self.root.rstrip("/") + "/"
        p = fs_path.rstrip("/")
        if not p.startswith(root):
            raise ValueError(f"{fs_path!r} is not below {self.root!r}")
        return p[len(root):]

    def read_bytes(self, *names: str) -> bytes:
        return self.fs.cat_file(self.path(*names))

    def write_bytes(self, data: bytes, *names: str) -> None:
        """Write a whole object; durable (fsync'd) on local filesystems, complete on object stores."""
        p = self.path(*names)
        if self.is_local:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(os.path.dirname(p))
        else:
            self.fs.pipe_file(p, data)

    def list_files(self) -> dict[str, int]:
        """Every file below the root with its size, in one recursive listing (one paginated LIST on s3)."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, int] = {}
        for p, info in found.items():
            if info.get("type") == "directory":
                continue
            try:
                out[self.relative(p)] = int(info.get("size") or 0)
            except ValueError:
                continue
        return out

    def remove_dir(self, name: str) -> None:
        p = self.path(name)
        try:
            self.fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass


def fsync_dir(path: str) -> None:
    """Make a new directory entry durable; best effort (not every filesystem supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_storage(url: str, storage_options: Optional[dict[str, Any]] = None) -> Storage:
    """Resolve a checkpoint URL to a `Storage`; raises StorageError for an unknown protocol."""
    if not url:
        raise StorageError("checkpoint.url is empty; set it to a path, file:///path or s3://bucket/prefix")
    url = url.rstrip("/") if url not in ("/",) else url
    opts = resolve_options(url, storage_options)
    try:
        fs, root = url_to_fs(url, **opts)
    except (ValueError, ImportError) as e:
        raise StorageError(f"checkpoint storage {url!r}: {e}; use a path, file://, s3:// or an installed "
                           f"fsspec protocol") from None
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if _is_local(protocol):
        # DCP's fsspec writer re-resolves the URL; a bare path becomes an absolute file:// URL for it.
        root = os.path.abspath(root)
        url = "file://" + root
    return Storage(url=url, fs=fs, root=root.rstrip("/") or "/", protocol=protocol, options=opts)


def explain_storage_error(exc: BaseException, storage: Storage, action: str = "access") -> StorageError:
    """A StorageError naming the URL, what went wrong and the fix, for an error raised by the filesystem."""
    url = storage.url
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    endpoint = endpoint_of(storage.options)
    if storage.protocol in _S3_PROTOCOLS:
        where = f"S3 endpoint {endpoint}" if endpoint else "the default AWS S3 endpoint"
        if any(s in low for s in ("could not connect", "connect timeout", "connection refused",
                                  "endpointconnectionerror", "cannot connect", "connectionerror",
                                  "name or service not known", "timed out")):
            return StorageUnreachableError(
                f"cannot {action} checkpoint storage {url}: {where} is unreachable ({text}); check that the server "
                f"is up and set checkpoint.storage_options.endpoint_url or AWS_ENDPOINT_URL")
        if any(s in low for s in ("invalidaccesskeyid", "signaturedoesnotmatch", "accessdenied", "forbidden",
                                  "403", "nocredentials", "unable to locate credentials")) \
                or isinstance(exc, PermissionError):
            return StorageError(f"cannot {action} checkpoint storage {url}: {where} refused the credentials "
                                f"({text}); set checkpoint.storage_options key/secret or AWS_ACCESS_KEY_ID / "
                                f"AWS_SECRET_ACCESS_KEY")
        if "nosuchbucket" in low or "bucket" in low and isinstance(exc, FileNotFoundError):
            bucket = storage.root.split("/", 1)[0]
            return StorageError(f"cannot {action} checkpoint storage {url}: bucket {bucket!r} does not exist at "
                                f"{where}; create it or fix checkpoint.url")
    if getattr(exc, "errno", None) == errno.ENOSPC:
        return StorageFullError(f"cannot {action} checkpoint storage {url}: no space left on device; free space "
                                f"or lower checkpoint.keep_last")
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) in (errno.EACCES, errno.EPERM,
                                                                           errno.EROFS) \
            or (storage.is_local and isinstance(exc, OSError)):
        return StorageError(f"cannot {action} checkpoint storage {url}: not writable ({text}); fix the "
                            f"directory's permissions or point checkpoint.url elsewhere")
    return StorageError(f"cannot {action} checkpoint storage {url}: {text}")


def check_storage(storage: Storage) -> None:
    """Probe that the root can be listed and written (create, write, delete a small object)."""
    probe = f".probe-{uuid.uuid4().hex}"
    try:
        if storage.is_local:
            os.makedirs(storage.root, exist_ok=True)
        elif storage.protocol in _S3_PROTOCOLS:
            bucket = storage.root.split("/", 1)[0]
            # ls on the bucket tells a missing bucket apart from an empty prefix.
            storage.fs.invalidate_cache()
            storage.fs.ls(bucket, detail=False)
        storage.write_bytes(b"ok", probe)
        storage.fs.rm(storage.path(probe))
    except FileNotFoundError as e:
        if storage.protocol in _S3_PROTOCOLS:
            bucket = storage.root.split("/", 1)[0]
            raise StorageError(f"cannot use checkpoint storage {storage.url}: bucket {bucket!r} does not exist "
                               f"at S3 endpoint {endpoint_of(storage.options) or '(default)'}; create it or fix "
                               f"checkpoint.url") from None
        raise explain_storage_error(e, storage, "write") from None
    except StorageError:
        raise
    except Exception as e:  # the filesystem's own error types vary by protocol
        raise explain_storage_error(e, storage, "write") from None


__all__ = ["Storage", "open_storage", "check_storage", "explain_storage_error", "resolve_options", "fsync_dir"]
