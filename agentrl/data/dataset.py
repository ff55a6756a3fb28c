"""Datasets of rows: validated on load, read in pieces, shuffled by seed, resumable.

``validate_files`` scans every file in record batches before any compute is spent and reports
every bad row at once (file, row index, field), and unknown ``agent_name``s.

``RowDataset`` never loads a file whole: it keeps, per file, only the row-group sizes from the
parquet footer, draws a seeded permutation of global row indices per epoch (8 bytes a row), and
reads rows through a small cache of decoded row groups. ``state_dict()`` is the position
(epoch and offset); loading it makes the following batches equal an uninterrupted run's.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow.parquet as pq
import torch
from pydantic import ValidationError

from agentrl.data.io import decode_row, iter_raw_rows
from agentrl.data.row import Row
from agentrl.errors import DataError

__all__ = ["row_uid", "parse_row", "validate_files", "RowDataset", "rows_from_dicts"]

MAX_REPORTED = 50


def row_uid(row: Row, file: str, index: int) -> str:
    """A stable id: data_source and extra_info.index when the row has one, else file and row."""
    if row.extra_info.index is not None:
        return f"{row.data_source}:{row.extra_info.index}"
    return f"{Path(file).stem}:{index}"


def parse_row(raw: dict[str, Any], *, file: str, index: int) -> Row:
    try:
        return Row.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        more = f" (and {len(exc.errors()) - 1} more problems in this row)" if len(exc.errors()) > 1 else ""
        raise DataError(f"{err['msg']}{more}", file=file, row=index, field=field) from None


def validate_files(
    paths: Sequence[str | Path],
    *,
    check_agent_names: Callable[[Iterable[str | None]], list[str]] | None = None,
    max_reported: int = MAX_REPORTED,
) -> list[DataError]:
    """Every problem in ``paths`` (capped at ``max_reported``, with a count of the rest)."""
    problems: list[DataError] = []
    extra = 0
    names: dict[str, tuple[str, int]] = {}
    for path in paths:
        try:
            for index, raw in iter_raw_rows(path):
                try:
                    row = parse_row(raw, file=str(path), index=index)
                except DataError as err:
                    if len(problems) < max_reported:
                        problems.append(err)
                    else:
                        extra += 1
                    continue
                if row.agent_name is not None:
                    names.setdefault(row.agent_name, (str(path), index))
        except DataError as err:
            problems.append(err)
    if check_agent_names is not None:
        for name, (file, index) in names.items():
            for message in check_agent_names([name]):
                problems.append(DataError(message, file=file, row=index, field="agent_name"))
    if extra:
        problems.append(DataError(f"... and {extra} more invalid rows"))
    return problems


class RowDataset:
    """Seeded, resumable batches of ``(row_uid, Row)`` over parquet files."""

    def __init__(
        self,
        files: Sequence[str | Path],
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        cache_row_groups: int = 8,
    ):
        if not files:
            raise DataError("no data files given")
        self.files = [str(f) for f in files]
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        # per file: cumulative row counts of its row groups (from the footer, no data read)
        self._group_starts: list[list[int]] = []
        self._file_starts: list[int] = [0]
        for path in self.files:
            try:
                meta = pq.ParquetFile(path).metadata
            except FileNotFoundError:
                raise DataError("file not found", file=path) from None
            except OSError as exc:
                raise DataError(f"not a readable parquet file: {exc}", file=path) from exc
            starts = [0]
            for g in range(meta.num_row_groups):
                starts.append(starts[-1] + meta.row_group(g).num_rows)
            self._group_starts.append(starts)
            self._file_starts.append(self._file_starts[-1] + starts[-1])
        self.num_rows = self._file_starts[-1]
        if self.num_rows == 0:
            raise DataError("the data files hold no rows", file=", ".join(self.files))
        if drop_last and self.num_rows < batch_size:
            raise DataError(f"{self.num_rows} rows cannot fill one batch of {batch_size}", file=", ".join(self.files))
        self._cache: OrderedDict[tuple[int, int], list[dict[str, Any]]] = OrderedDict()
        self._cache_size = cache_row_groups
        self.reads = 0  # row groups decoded (for tests and progress)
        self.epoch = 0
        self.offset = 0  # rows of this epoch's order already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_rows)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=generator)

    def _row_group(self, file_index: int, group: int) -> list[dict[str, Any]]:
        key = (file_index, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        rows = pq.ParquetFile(self.files[file_index]).read_row_group(group).to_pylist()
        self.reads += 1
        self._cache[key] = rows
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return rows

    def row(self, global_index: int) -> tuple[str, Row]:
        file_index = bisect.bisect_right(self._file_starts, global_index) - 1
        local = global_index - self._file_starts[file_index]
        starts = self._group_starts[file_index]
        group = bisect.bisect_right(starts, local) - 1
        raw = dict(self._row_group(file_index, group)[local - starts[group]])
        raw = decode_row(raw)
        path = self.files[file_index]
        row = parse_row(raw, file=path, index=local)
        return row_uid(row, path, local), row

    def next_batch(self) -> list[tuple[str, Row]]:
        """The next batch, moving to the next epoch (a new order) when this one runs out."""
        order = self._order(self.epoch)
        remaining = self.num_rows - self.offset
        if remaining < self.batch_size and (self.drop_last or remaining == 0):
            self.epoch, self.offset = self.epoch + 1, 0
            order = self._order(self.epoch)
        indices = order[self.offset : self.offset + self.batch_size].tolist()
        self.offset += len(indices)
        return [self.row(i) for i in indices]

    def __iter__(self) -> Iterator[list[tuple[str, Row]]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed:
            raise DataError(
                f"cannot resume: the saved position is for {state['num_rows']} rows with seed {state['seed']}, "
                f"these files hold {self.num_rows} rows with seed {self.seed}"
            )
        self.epoch, self.offset = state["epoch"], state["offset"]


def rows_from_dicts(rows: Sequence[dict[str, Any]], source: str = "<generated>") -> list[tuple[str, Row]]:
    """Validate in-memory rows (e.g. generated tasks) as a dataset would."""
    out = []
    for index, raw in enumerate(rows):
        row = parse_row(raw, file=source, index=index)
        out.append((row_uid(row, source, index), row))
    return out
