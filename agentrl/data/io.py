"""Reading and writing row parquet files with pyarrow, in record batches.

Free-form nested values - ``extra_info.tools_kwargs``, ``extra_info.interaction_kwargs``,
``extra_info.environment``, the
``tool_calls`` of a prompt message and an SFT ``messages`` column - are stored as JSON text:
Arrow structs need one schema for every row (and cannot be empty), while these differ from row
to row (each tool has its own create kwargs). Reading accepts both JSON text and verl's structs.

Arrow merges the struct fields of all rows, so a key that only some rows have reads back as
``None`` in the others; reading drops those ``None`` members again (in a parquet struct a
missing key and a null are the same thing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from agentrl.errors import DataError

if TYPE_CHECKING:
    import pyarrow.parquet as pq

__all__ = ["JSON_FIELDS", "ROW_GROUP_SIZE", "write_rows", "iter_raw_rows", "decode_row", "count_rows", "open_parquet"]

JSON_FIELDS = (("extra_info", "tools_kwargs"), ("extra_info", "interaction_kwargs"), ("extra_info", "environment"), ("prompt", "*", "tool_calls"), ("messages",))
# Rows per row group when writing: the unit a shuffled dataset decodes to reach one row, so it
# bounds both the memory of its cache and the work of a random read.
ROW_GROUP_SIZE = 1024
_EXTRA_JSON = ("tools_kwargs", "interaction_kwargs", "environment")
_STRUCTS = ("extra_info", "reward_model")


def _encode(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    if isinstance(row.get("extra_info"), dict):
        extra = dict(row["extra_info"])
        for key in _EXTRA_JSON:
            if key in extra and not isinstance(extra[key], str):
                extra[key] = json.dumps(extra[key])
        row["extra_info"] = extra
    if "messages" in row and not isinstance(row["messages"], str):
        row["messages"] = json.dumps(row["messages"])
    if isinstance(row.get("prompt"), list):
        prompt = []
        for message in row["prompt"]:
            message = dict(message)
            if message.get("content") is None:
                message["content"] = ""
            if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], str):
                message["tool_calls"] = json.dumps(message["tool_calls"])
            prompt.append(message)
        row["prompt"] = prompt
    return row


def _drop_nulls(value: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if v is not None}


def _drop_nulls_deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls_deep(v) for k, v in value.items() if v is not None}
    return value


class _UndecodableField(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _loads(text: str, field: str) -> Any:
    """A JSON-encoded column value; data from elsewhere may be malformed or nested too deep to parse."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _UndecodableField(field, f"not valid JSON ({str(exc)[:120]})") from None


def decode_row(row: dict[str, Any]) -> dict[str, Any]:
    """Undo the JSON encoding of a row read from parquet (verl's structs pass through)."""
    for key in _STRUCTS:
        if isinstance(row.get(key), dict):
            row[key] = _drop_nulls(row[key])
        elif key in row and row[key] is None:  # a row written without it, in a file where others have it
            del row[key]
    extra = row.get("extra_info")
    if isinstance(extra, dict):
        for key in _EXTRA_JSON:
            value = extra.get(key)
            if isinstance(value, str):
                extra[key] = _loads(value, f"extra_info.{key}") if value else None
            elif isinstance(value, dict):  # verl's struct: drop the null members Arrow added
                extra[key] = _drop_nulls_deep(value)
    if isinstance(row.get("messages"), str):
        row["messages"] = _loads(row["messages"], "messages")
    if isinstance(row.get("prompt"), list):
        prompt = []
        for i, message in enumerate(row["prompt"]):
            if isinstance(message, dict):
                message = _drop_nulls(message)
                if isinstance(message.get("tool_calls"), str):
                    message["tool_calls"] = _loads(message["tool_calls"], f"prompt.{i}.tool_calls")
            prompt.append(message)
        row["prompt"] = prompt
    return row


def write_rows(rows: list[dict[str, Any]], path: str | Path, *, row_group_size: int = ROW_GROUP_SIZE) -> Path:
    """Write rows to parquet atomically (a temporary file, fsynced, renamed into place).

    Every top-level key of any row becomes a column (rows without it hold null there). Public
    as ``agentrl.write_rows``: the writer for a plugin's own data source. pyarrow is imported
    here, not at module level, so that ``import agentrl`` stays cheap."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    encoded = [_encode(r) for r in rows]
    # Table.from_pylist takes its columns from the first row alone; take them from every row.
    keys = list(dict.fromkeys(k for r in encoded for k in r))
    columns = {}
    for key in keys:
        try:
            columns[key] = pa.array([r.get(key) for r in encoded])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DataError(f"column {key}: {exc} (its values must share one type across rows)", file=str(path)) from exc
    table = pa.table(columns)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        pq.write_table(table, f, row_group_size=row_group_size)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def open_parquet(path: str | Path) -> "pq.ParquetFile":
    """Open a parquet file, or raise a DataError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except FileNotFoundError:
        raise DataError("file not found", file=str(path)) from None
    except IsADirectoryError:
        raise DataError("is a directory, not a parquet file", file=str(path)) from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"not a readable parquet file: {exc}", file=str(path)) from exc


def count_rows(path: str | Path) -> int:
    return int(open_parquet(path).metadata.num_rows)


def iter_raw_rows(path: str | Path, *, batch_size: int = 1024, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row index, decoded row dict) for every row, reading one record batch at a time. A row whose
    JSON-encoded field cannot be decoded ends the file with a DataError naming row and field."""
    parquet = open_parquet(path)
    if columns is not None:
        missing = [c for c in columns if c not in parquet.schema_arrow.names]
        if missing:
            raise DataError(f"missing column(s) {', '.join(missing)} (the file has: {', '.join(parquet.schema_arrow.names)})", file=str(path))
    index = 0
    for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
        for row in batch.to_pylist():
            try:
                decoded = decode_row(row)
            except _UndecodableField as exc:
                raise DataError(str(exc), file=str(path), row=index, field=exc.field) from None
            yield index, decoded
            index += 1
