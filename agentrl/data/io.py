"""Reading and writing row files: parquet with pyarrow, in record batches; JSON rows (``.jsonl``,
``.json``) with the same schema, read through ``JsonRows``.

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
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from agentrl.errors import DataError

if TYPE_CHECKING:
    import pyarrow.parquet as pq

__all__ = ["JSON_FIELDS", "ROW_GROUP_SIZE", "JSON_SUFFIXES", "write_rows", "iter_raw_rows", "decode_row", "count_rows", "open_parquet",
           "is_json_rows", "JsonRows"]

JSON_FIELDS = (("extra_info", "tools_kwargs"), ("extra_info", "interaction_kwargs"), ("extra_info", "environment"), ("prompt", "*", "tool_calls"), ("messages",))
# Rows per row group when writing: the unit a shuffled dataset decodes to reach one row, so it
# bounds both the memory of its cache and the work of a random read.
ROW_GROUP_SIZE = 1024
JSON_SUFFIXES = (".jsonl", ".json")  # row files read as JSON rows, not parquet
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
        raise DataError(f"not a readable parquet file: {exc} (row files are parquet, or JSON Lines named .jsonl or .json)",
                        file=str(path)) from exc


def count_rows(path: str | Path) -> int:
    """The rows of a row file: parquet, or JSON (``.jsonl``, ``.json``: ``JsonRows``)."""
    return JsonRows(path).num_rows if is_json_rows(path) else int(open_parquet(path).metadata.num_rows)


def iter_raw_rows(path: str | Path, *, batch_size: int = 1024, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row index, decoded row dict) for every row, reading one record batch at a time. A row whose
    JSON-encoded field cannot be decoded ends the file with a DataError naming row and field.
    A ``.jsonl`` or ``.json`` file is read as JSON rows (``JsonRows``); ``columns``
    then keeps those keys of each row (a key a row lacks reads as None)."""
    if is_json_rows(path):
        for index, row in JsonRows(path):
            yield index, row if columns is None else {c: row.get(c) for c in columns}
        return
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


def is_json_rows(path: str | Path) -> bool:
    """A row file read as JSON (by its suffix), not as parquet."""
    return Path(path).suffix.lower() in JSON_SUFFIXES


class JsonRows:
    """The rows of one JSON row file: their count, groups and lines, and each row decoded.

    JSON Lines (``.jsonl``, and ``.json`` written one object a line, as Hugging Face
    ``datasets``' ``to_json`` writes them) is never loaded whole: opening it records the byte
    offset and line number of every row (16 bytes a row) and rows are read back a group of
    ``group_size`` at a time, as parquet row groups are. Blank lines are skipped; a problem names
    the row (0-based, blank lines not counted) and its line (1-based). A ``.json`` file holding
    one JSON array of rows is read whole."""

    def __init__(self, path: str | Path, *, group_size: int = ROW_GROUP_SIZE):
        self.path, self.group_size = str(path), group_size
        self._texts: list[bytes] | None = None  # a JSON array's rows, re-encoded one by one
        self._offsets, self._lines = array("q"), array("q")
        try:
            with open(path, "rb") as f:
                head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
                f.seek(0)
                if head.startswith(b"["):
                    self._read_array(f.read())
                else:
                    self._index(f)
        except FileNotFoundError:
            raise DataError("file not found", file=self.path) from None
        except IsADirectoryError:
            raise DataError("is a directory, not a row file", file=self.path) from None

    def _index(self, f: Any) -> None:
        position = 0
        for number, text in enumerate(f, 1):
            if text.strip():
                self._offsets.append(position)
                self._lines.append(number)
            position += len(text)

    def _read_array(self, data: bytes) -> None:
        try:
            rows = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise DataError(f"not valid JSON ({str(exc)[:120]}); a .json row file is a JSON array of rows or one row a line",
                            file=self.path) from None
        self._texts = [json.dumps(row).encode() for row in rows]

    @property
    def num_rows(self) -> int:
        return len(self._texts) if self._texts is not None else len(self._offsets)

    def line(self, index: int) -> int | None:
        """The 1-based line of row ``index`` (None in a JSON array)."""
        return None if self._texts is not None else int(self._lines[index])

    def group_sizes(self) -> list[int]:
        full, rest = divmod(self.num_rows, self.group_size)
        return [self.group_size] * full + ([rest] if rest else [])

    def read_texts(self, start: int, stop: int) -> list[bytes]:
        """The JSON text of rows ``[start, stop)``."""
        if self._texts is not None:
            return self._texts[start:stop]
        if start >= stop:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offsets[start])
            texts, wanted = [], stop - start
            for text in f:
                if text.strip():
                    texts.append(text)
                    if len(texts) == wanted:
                        break
        return texts

    def decode(self, index: int, text: bytes) -> dict[str, Any]:
        """Row ``index`` from its JSON text, its JSON-text fields decoded (``decode_row``)."""

        def error(message: str, field: str | None = None) -> DataError:
            return DataError(message, file=self.path, row=index, field=field, line=self.line(index))

        try:
            row = json.loads(text.rstrip(b"\r\n"))
        except json.JSONDecodeError as exc:  # its own line and column would count within the row's text
            raise error(f"not valid JSON ({exc.msg} at column {exc.colno}); a JSON Lines file holds one row object a line") from None
        except (ValueError, RecursionError) as exc:
            raise error(f"not valid JSON ({str(exc)[:120]}); a JSON Lines file holds one row object a line") from None
        if not isinstance(row, dict):
            raise error(f"a row must be a JSON object, got {type(row).__name__}")
        try:
            return decode_row(row)
        except _UndecodableField as exc:
            raise error(str(exc), exc.field) from None

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(row index, decoded row) in file order, a group of rows read at a time."""
        for start in range(0, self.num_rows, self.group_size):
            for offset, text in enumerate(self.read_texts(start, min(start + self.group_size, self.num_rows))):
                yield start + offset, self.decode(start + offset, text)
