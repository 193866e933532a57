"""Rows of a local dataset (JSON lines, Parquet, or a `datasets` directory from `save_to_disk`), nothing downloaded.

Every rank reads the whole dataset at start: packing (runtime/packing.py) needs every sample's length, and
must come out the same on every rank at any world size. A missing file, a missing column or a library that is not
installed is one `ConfigError` line naming the `data.*` field and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from elastictrain.config import DataConfig
from elastictrain.errors import ConfigError, DataError

Row = dict[str, Any]
INSTALL_HINT = "pip install 'elastictrain[sft]'"


def read_rows(cfg: DataConfig) -> list[Row]:
    """The dataset's rows, in file order (a row's position is its sample id in the ledger)."""
    path = Path(str(cfg.path)).expanduser()
    if not path.exists():
        raise ConfigError(f"data.path={str(path)!r} does not exist; point data.path at a local "
                          f"{_what(cfg.source)}")
    if cfg.source == "jsonl":
        rows = _jsonl(path)
    elif cfg.source == "parquet":
        rows = _parquet(path)
    else:
        rows = _hf_disk(path, cfg.split)
    if not rows:
        raise DataError(f"data.path={str(path)!r} holds no rows; point data.path at a non-empty {_what(cfg.source)}")
    check_columns(rows, cfg, str(path))
    return rows


def _what(source: str) -> str:
    return {"jsonl": "JSON-lines file", "parquet": "Parquet file or directory",
            "hf_disk": "directory written by datasets' save_to_disk"}[source]


def _jsonl(path: Path) -> list[Row]:
    if not path.is_file():
        raise ConfigError(f"data.path={str(path)!r} is not a file; data.source=jsonl reads one JSON-lines file")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not a JSON object ({e.msg}); fix that line of data.path") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: a JSON {type(row).__name__}, not an object; each line of data.path "
                                f"must be one JSON object")
            rows.append(row)
    return rows


def _parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data.source=parquet needs pyarrow, which is not installed; {INSTALL_HINT}") from None
    try:
        return pq.read_table(str(path)).to_pylist()
    except (OSError, ValueError) as e:
        raise DataError(f"data.path={str(path)!r}: cannot read it as Parquet ({e})") from None


def _hf_disk(path: Path, split: str) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.source=hf_disk needs the datasets library, which is not installed; "
                          f"{INSTALL_HINT}") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ConfigError(f"data.path={str(path)!r} is not a directory written by save_to_disk ({e}); point "
                          f"data.path at one") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"data.split={split!r} is not a split of data.path={str(path)!r} (it has "
                              f"{', '.join(ds)}); set data.split to one of them")
        ds = ds[split]
    return ds.to_list()


def check_columns(rows: list[Row], cfg: DataConfig, where: str) -> None:
    """Every row has the columns that `cfg.format` reads; else one line naming the row, the field and the fix."""
    if cfg.format == "text":
        _require(rows, [cfg.text_field], where, "data.text_field")
    elif cfg.messages_field in rows[0]:
        _require(rows, [cfg.messages_field], where, "data.messages_field")
    elif cfg.prompt_field in rows[0] or cfg.response_field in rows[0]:
        _require(rows, [cfg.prompt_field, cfg.response_field], where, "data.prompt_field / data.response_field")
    else:
        raise ConfigError(f"data.path={where!r}: data.format=chat needs a column {cfg.messages_field!r} "
                          f"(data.messages_field) or {cfg.prompt_field!r} and {cfg.response_field!r} "
                          f"(data.prompt_field, data.response_field); the rows have {_columns(rows[0])}; set "
                          f"those fields to the dataset's column names")


def _require(rows: list[Row], columns: list[str], where: str, fields: str) -> None:
    for n, row in enumerate(rows):
        missing = [c for c in columns if c not in row or row[c] is None]
        if missing:
            raise ConfigError(f"data.path={where!r}: row {n} has no column {missing[0]!r} ({fields}); it has "
                              f"{_columns(row)}; set {fields} to the dataset's column name or fix the row")


def _columns(row: Row) -> str:
    return ", ".join(repr(k) for k in row) or "no columns"


def text_of(value: Any, where: Iterable[str]) -> str:
    """A cell that must hold a string; else one line naming the row and column."""
    if not isinstance(value, str):
        raise DataError(f"{' '.join(where)} holds a {type(value).__name__}, not a string")
    return value
