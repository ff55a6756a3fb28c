"""Reading and writing row parquet files with pyarrow, in record batches.

Free-form nested values - ``extra_info.tools_kwargs``, ``extra_info.interaction_kwargs`` and an
SFT ``messages`` column - are stored as JSON text: Arrow structs need one schema for every
row (and cannot be empty), while these differ from row to row (each tool has its own create
kwargs). Reading accepts both JSON text and verl's structs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from agentrl.errors import DataError

__all__ = ["JSON_FIELDS", "write_rows", "iter_raw_rows", "decode_row", "count_rows"]

JSON_FIELDS = (("extra_info", "tools_kwargs"), ("extra_info", "interaction_kwargs"), ("messages",))


def _encode(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    if "extra_info" in row and isinstance(row["extra_info"], dict):
        extra = dict(row["extra_info"])
        for key in ("tools_kwargs", "interaction_kwargs"):
            if key in extra and not isinstance(extra[key], str):
                extra[key] = json.dumps(extra[key])
        row["extra_info"] = extra
    if "messages" in row and not isinstance(row["messages"], str):
        row["messages"] = json.dumps(row["messages"])
    if "prompt" in row:
        # only role/content are columns; tool calls inside a prompt travel as JSON text
        row["prompt"] = [
            {"role": m["role"], "content": m.get("content") or "", **({"tool_calls": json.dumps(m["tool_calls"])} if m.get("tool_calls") else {})}
            for m in row["prompt"]
        ]
    return row


def decode_row(row: dict[str, Any]) -> dict[str, Any]:
    """Undo the JSON encoding of a row read from parquet (structs pass through)."""
    extra = row.get("extra_info")
    if isinstance(extra, dict):
        for key in ("tools_kwargs", "interaction_kwargs"):
            value = extra.get(key)
            if isinstance(value, str):
                extra[key] = json.loads(value) if value else None
            elif isinstance(value, dict):  # verl's struct: drop the null members Arrow added
                extra[key] = {k: v for k, v in value.items() if v is not None}
    if isinstance(row.get("messages"), str):
        row["messages"] = json.loads(row["messages"])
    for message in row.get("prompt") or []:
        if isinstance(message, dict):
            if isinstance(message.get("tool_calls"), str):
                message["tool_calls"] = json.loads(message["tool_calls"])
            elif message.get("tool_calls") is None:
                message.pop("tool_calls", None)
    return row


def write_rows(rows: list[dict[str, Any]], path: str | Path, *, row_group_size: int | None = None) -> Path:
    """Write rows atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([_encode(r) for r in rows])
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, row_group_size=row_group_size)
    os.replace(tmp, path)
    return path


def count_rows(path: str | Path) -> int:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except FileNotFoundError:
        raise DataError("file not found", file=str(path)) from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"not a readable parquet file: {exc}", file=str(path)) from exc


def iter_raw_rows(path: str | Path, *, batch_size: int = 1024, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row index, decoded row dict) for every row, reading one record batch at a time."""
    try:
        parquet = pq.ParquetFile(path)
    except FileNotFoundError:
        raise DataError("file not found", file=str(path)) from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"not a readable parquet file: {exc}", file=str(path)) from exc
    index = 0
    for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
        for row in batch.to_pylist():
            yield index, decode_row(row)
            index += 1
