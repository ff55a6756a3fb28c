"""Datasets of rows: validated on load, read in pieces, shuffled by seed, resumable.

``validate_files`` scans every file in record batches before any compute is spent and reports
every bad row at once (file, 0-based row index within the file, field path such as
``prompt.0.role``), and every row whose ``agent_name`` is not a known agent loop. The known names
come from the caller (``PluginRegistry().names("agent_loops")`` plus aliases): the plugin
registry is the source of truth, and the data layer imports no loop.

``RowDataset`` never loads a file whole. It keeps, per file, only the row-group sizes from the
parquet footer, draws a seeded permutation of the global row indices per epoch (8 bytes a row:
80 MB for 10^7 rows; beyond ~10^8 rows split the data into several runs), and reads the rows of
a batch through a small byte-bounded LRU cache of decoded row groups (kept as Arrow tables;
only the rows asked for become Python objects). A random read therefore costs one row group:
write files with small row groups (``write_rows`` uses 1,024 rows; HF ``datasets`` files, as
verl's preprocessing writes them, already have about 1,000), and a file whose row group alone
exceeds the cache budget is refused with a message saying how to rewrite it. Time and memory
per batch: ``python -m agentrl_benchmarks.data_reader``, figures in docs/benchmarks.md.

``state_dict()`` is the position (epoch, offset into the epoch's order, seed); loading it makes
the following batches equal an uninterrupted run's.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from agentrl.config.environment_names import environment_problem
from agentrl.config.schema import environment_import_hint
from agentrl.data.ground_truth import GroundTruthRule
from agentrl.data.io import JsonRows, decode_row, is_json_rows, iter_raw_rows, open_parquet
from agentrl.data.row import EnvironmentRef, Row
from agentrl.errors import DataError

__all__ = ["MAX_REPORTED", "counted", "row_uid", "file_tags", "parse_row", "row_plugin_problems", "validate_files", "RowDataset", "rows_from_dicts"]

MAX_REPORTED = 50
CACHE_BYTES = 256 << 20


def counted(n: int, noun: str) -> str:
    """``1 problem``, ``2 problems``: a count with its noun in the right number."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def row_uid(row: Row, file: str, index: int) -> str:
    """A stable id: ``data_source:extra_info.index`` when the row has an index, else
    ``file_stem:row_number`` (the row's 0-based position in its file)."""
    if row.extra_info.index is not None:
        return f"{row.data_source}:{row.extra_info.index}"
    return f"{Path(file).stem}:{index}"


def file_tags(files: Sequence[str | Path]) -> list[str]:
    """A prefix per file for the row uids of a dataset of several files: verl's files each index
    their rows from 0, so ``data_source:index`` repeats across files. One file: no prefix (its
    uids stay as they were); several: ``<file stem>/`` (``<position>.<stem>/`` if stems repeat)."""
    if len(files) <= 1:
        return [""] * len(files)
    stems = [Path(f).stem for f in files]
    unique = len(set(stems)) == len(stems)
    return [f"{stem}/" if unique else f"{i}.{stem}/" for i, stem in enumerate(stems)]


def parse_row(raw: dict[str, Any], *, file: str, index: int, line: int | None = None) -> Row:
    """Validate one decoded row; a DataError names the file, the row (and its ``line`` in a JSON
    Lines file) and the first bad field."""
    try:
        return Row.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        field = ".".join(str(p) for p in errors[0]["loc"]) or None
        more = f" (and {counted(len(errors) - 1, 'more problem')} in this row)" if len(errors) > 1 else ""
        raise DataError(f"{errors[0]['msg']}{_got(errors[0])}{more}", file=file, row=index, field=field, line=line) from None


def _got(error: Any) -> str:
    """`` (got 'robot')``: the bad value of a field, when it is a single value short enough to echo
    (a missing field has none; a whole message or list would drown the line)."""
    value = error.get("input")
    if error["type"] == "missing" or not isinstance(value, (str, int, float, bool, type(None))):
        return ""
    text = repr(value)
    return f" (got {text if len(text) <= 80 else text[:77] + '...'})"


def validate_files(
    paths: Sequence[str | Path],
    *,
    known_agent_names: Collection[str] | None = None,
    default_agent: str | None = None,
    known_tools: Collection[str] | None = None,
    known_interactions: Collection[str] | None = None,
    import_problem: Callable[[str, str], str | None] | None = None,
    max_reported: int = MAX_REPORTED,
    known_agents: Collection[str] | None = None,
    default_environment: EnvironmentRef | None = None,
    config_known: bool = False,
    ground_truth: GroundTruthRule | None = None,
) -> list[DataError]:
    """Every problem in ``paths``, in file and row order: missing or unreadable files, rows that
    fail validation, and (for each ``known_*`` given) rows naming a plugin that is not among
    them: an ``agent_name`` (or, for rows without one, ``default_agent``), a tool (the keys of
    ``extra_info.tools_kwargs``), an interaction (``extra_info.interaction_kwargs.name``) or an
    agent program (``extra_info.agent_program``, the ``openai_agent`` loop's), or the loop of its
    environment's library (``extra_info.environment``, else ``default_environment``: the config's).
    With ``config_known`` (``default_environment`` is the run's config's, None when it has none),
    a row's environment that names nothing and cannot take the config's name is a problem too;
    with ``ground_truth`` (the run's reward settings), so is a row without the ground truth its
    reward compares the answer with (``GroundTruthRule``).
    ``import_problem(group, name)`` (``PluginRegistry.import_problem``), when given, is asked
    about each plugin a row names, so one that is installed but fails to import is reported at
    the first row naming it, before any model is loaded. At most ``max_reported`` problems are
    listed; one more entry then says how many were left out."""
    found = _Problems(max_reported)
    known = set(known_agent_names) if known_agent_names is not None else None
    known_text = ", ".join(sorted(known)) if known is not None else ""
    first_defaulted: tuple[str, int] | None = None  # the first row without agent_name
    defaulted = 0
    for path in dict.fromkeys(map(str, paths)):  # a file given twice (as training and validation data) is read once
        try:
            json_rows = JsonRows(path) if is_json_rows(path) else None
            for index, raw in json_rows if json_rows is not None else iter_raw_rows(path):
                line = json_rows.line(index) if json_rows is not None else None
                try:
                    row = parse_row(raw, file=path, index=index, line=line)
                except DataError as err:
                    found.add(err)
                    continue
                if row.loop_name(default_environment) is None:
                    first_defaulted = first_defaulted or (path, index)
                    defaulted += 1
                for field, problem in row_plugin_problems(row, known, known_tools, known_interactions, import_problem,
                                                          agents=known_agents, default_environment=default_environment,
                                                          config_known=config_known):
                    found.add(DataError(problem, file=path, row=index, field=field, line=line))
                if ground_truth is not None and (problem := ground_truth.problem(row, default_environment)) is not None:
                    found.add(DataError(problem, file=path, row=index, field="reward_model.ground_truth", line=line))
        except DataError as err:
            found.add(err)
    if known is not None and default_agent is not None and default_agent not in known and first_defaulted:
        file, index = first_defaulted
        found.items.insert(0, DataError(  # a configuration problem: listed first, never left out
            f"no agent_name, and the default agent {default_agent!r} is unknown (known: {known_text}); "
            f"{counted(defaulted, 'row')} {'has' if defaulted == 1 else 'have'} no agent_name", file=file, row=index, field="agent_name",
        ))
    return found.report()


def row_plugin_problems(
    row: Row,
    loops: Collection[str] | None,
    tools: Collection[str] | None,
    interactions: Collection[str] | None,
    import_problem: Callable[[str, str], str | None] | None = None,
    *,
    agents: Collection[str] | None = None,
    default_environment: EnvironmentRef | None = None,
    config_known: bool = False,
) -> Iterator[tuple[str, str]]:
    """``(field, problem)`` for each plugin the row names that is not among the known names of
    its kind (a kind whose names are None is not checked) or, asked through ``import_problem``,
    fails to import: its ``agent_name``, its tools (the keys of ``extra_info.tools_kwargs``), its
    interaction, its agent program (``extra_info.agent_program``), and its environment
    (``extra_info.environment``: the name, and its library's loop when the row names no
    ``agent_name``; the config's ``default_environment`` is checked once, by the config loader;
    with ``config_known``, a row's environment without a name that the config's cannot give one,
    OpenEnv's aside: ``environment.openenv.url`` may serve it)."""
    named = []
    if row.agent_name is not None:
        named.append(("agent_name", "agent_loops", "agent_name", row.agent_name, loops))
    own = row.extra_info.environment
    ref = row.environment_ref(default_environment)
    if row.agent_name is None and ref is not None:
        where = "extra_info.environment.library" if own is not None else "environment.library"
        named.append((where, "agent_loops", f"{ref.library} loop", ref.loop, loops))
    if own is not None and own.name is not None:
        named.append(("extra_info.environment.name", "environments", f"{own.library} environment", own.name, None))
    elif config_known and own is not None and ref is not None and ref.name is None and own.library != "openenv":
        config = ("the config's environment names none either" if default_environment is not None
                  and default_environment.library == own.library else f"the config's is {default_environment.library}"
                  if default_environment is not None else "the config names none")
        yield ("extra_info.environment.name", f"the row's {own.library} environment names nothing and {config}: set "
               f"extra_info.environment.name, or environment.library={own.library} with environment.name")
    named += [(f"extra_info.tools_kwargs.{name}", "tools", "tool", name, tools) for name in row.extra_info.tools_kwargs]
    spec = row.extra_info.interaction_kwargs
    if spec is not None and spec.name is not None:
        named.append(("extra_info.interaction_kwargs.name", "interactions", "interaction", spec.name, interactions))
    program = getattr(row.extra_info, "agent_program", None)
    if program is not None:
        named.append(("extra_info.agent_program", "agents", "agent program", str(program), agents))
    for field, group, kind, name, known in named:
        if known is not None and name not in known:
            yield field, f"unknown {kind} {name!r} (known: {', '.join(sorted(known)) or 'none'})"
        elif import_problem is not None and (problem := environment_problem(import_problem, own.library, name)
                                             if group == "environments" and own else import_problem(group, name)) is not None:
            hint = f" ({environment_import_hint(own.library, name)})" if group == "environments" and own else ""
            yield field, f"{kind} {name!r} cannot be loaded: {problem}{hint}"


class _Problems:
    """A capped list of problems that counts what it leaves out. A problem met again in another
    row of the same file and field (a missing package named by every row) is listed once, with
    the rows it was met in and their file."""

    def __init__(self, cap: int):
        self.cap, self.items, self.left_out = cap, [], 0
        self.again: dict[tuple[str | None, str | None, str], list[int]] = {}  # (file, field, message) -> later rows

    def add(self, problem: DataError) -> None:
        key = (problem.file, problem.field, problem.message)
        if problem.row is not None and key in self.again:
            self.again[key].append(problem.row)
        elif len(self.items) < self.cap:
            self.items.append(problem)
            if problem.row is not None:
                self.again[key] = []
        else:
            self.left_out += 1

    def report(self) -> list[DataError]:
        listed = []
        for problem in self.items:
            rows = self.again.get((problem.file, problem.field, problem.message)) if problem.row is not None else None
            if rows:
                shown = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
                where = f"row{'s' if len(rows) > 1 else ''} {shown} of {problem.file}"
                problem = DataError(f"{problem.message} (the same in {where})", file=problem.file, row=problem.row, field=problem.field,
                                    line=problem.line)
            listed.append(problem)
        if self.left_out:
            listed.append(DataError(f"... and {counted(self.left_out, 'more problem')} (only the first {self.cap} are listed)"))
        return listed


class RowDataset:
    """Seeded, resumable batches of ``(row_uid, Row)`` over parquet files.

    ``cache_bytes`` bounds the decoded row groups kept in memory (Arrow bytes)."""

    def __init__(
        self,
        files: Sequence[str | Path],
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        cache_bytes: int = CACHE_BYTES,
    ):
        if not files:
            raise DataError("no data files given")
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size}")
        self.files = [str(f) for f in files]
        self._tags = file_tags(self.files)
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.cache_bytes = cache_bytes
        # per file: cumulative row counts of its row groups (from the footer, no data read)
        self._group_starts: list[list[int]] = []
        self._file_starts: list[int] = [0]
        self._json: dict[int, JsonRows] = {}  # JSON row files by position: their rows' offsets, read in groups
        for i, path in enumerate(self.files):
            if is_json_rows(path):
                self._json[i] = JsonRows(path)
                starts = [0]
                for size in self._json[i].group_sizes():
                    starts.append(starts[-1] + size)
                self._group_starts.append(starts)
                self._file_starts.append(self._file_starts[-1] + starts[-1])
                continue
            meta = open_parquet(path).metadata
            starts = [0]
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                if group.total_byte_size > cache_bytes:
                    raise DataError(
                        f"row group {g} holds {counted(group.num_rows, 'row')} ({group.total_byte_size / 2**20:.0f} MiB decoded), more than "
                        f"the row cache's {cache_bytes / 2**20:.0f} MiB; rows are read a row group at a time, so rewrite the file "
                        "with smaller row groups (agentrl.write_rows or pyarrow.parquet.write_table(..., row_group_size=1024))",
                        file=path,
                    )
                starts.append(starts[-1] + group.num_rows)
            self._group_starts.append(starts)
            self._file_starts.append(self._file_starts[-1] + starts[-1])
        self.num_rows = self._file_starts[-1]
        if self.num_rows == 0:
            raise DataError("the data files hold no rows", file=", ".join(self.files))
        if drop_last and self.num_rows < batch_size:
            raise DataError(f"{counted(self.num_rows, 'row')} cannot fill one batch of {batch_size}", file=", ".join(self.files))
        self._parquet: dict[int, pq.ParquetFile] = {}
        # decoded row groups: an Arrow table (parquet) or the rows' JSON texts (JSON rows)
        self._cache: OrderedDict[tuple[int, int], pa.Table | list[bytes]] = OrderedDict()
        self._cached_bytes = 0
        self._order_of: tuple[int, Any] | None = None  # (epoch, its order: an int64 tensor or a range)
        self.reads = 0  # row groups decoded (for tests and progress)
        self.epoch = 0
        self.offset = 0  # rows of this epoch's order already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def __getstate__(self) -> dict[str, Any]:
        # open files and decoded row groups stay behind when the dataset is pickled
        return {**self.__dict__, "_parquet": {}, "_cache": OrderedDict(), "_cached_bytes": 0, "_order_of": None}

    def order(self, epoch: int, start: int = 0, stop: int | None = None) -> list[int]:
        """Global row indices ``[start:stop]`` of one epoch's order (the order batches follow)."""
        if self._order_of is None or self._order_of[0] != epoch:
            if self.shuffle:
                import torch  # imported here: reading data in order, or validating it, needs no torch

                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                # kept as a tensor: 8 bytes a row, where a list of Python ints takes ~36
                self._order_of = (epoch, torch.randperm(self.num_rows, generator=generator))
            else:
                self._order_of = (epoch, range(self.num_rows))
        window = self._order_of[1][start:stop]
        return window.tolist() if hasattr(window, "tolist") else list(window)

    def _locate(self, global_index: int) -> tuple[int, int, int]:
        """(file, row group, row within the group) of a global row index."""
        if not 0 <= global_index < self.num_rows:
            raise IndexError(f"row {global_index} is outside the dataset's {self.num_rows} rows")
        file_index = bisect.bisect_right(self._file_starts, global_index) - 1
        local = global_index - self._file_starts[file_index]
        starts = self._group_starts[file_index]
        group = bisect.bisect_right(starts, local) - 1
        return file_index, group, local - starts[group]

    def _row_group(self, file_index: int, group: int) -> pa.Table | list[bytes]:
        key = (file_index, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if file_index in self._json:
            starts = self._group_starts[file_index]
            return self._keep(key, self._json[file_index].read_texts(starts[group], starts[group + 1]))
        if file_index not in self._parquet:
            self._parquet[file_index] = open_parquet(self.files[file_index])
        try:
            table = self._parquet[file_index].read_row_group(group, use_threads=False)  # one small group: threads do not pay
        except (pa.ArrowException, OSError) as exc:  # the footer opened, the pages are damaged
            raise DataError(f"row group {group} is not readable: {exc}", file=self.files[file_index]) from exc
        return self._keep(key, table)

    def _keep(self, key: tuple[int, int], group: pa.Table | list[bytes]) -> pa.Table | list[bytes]:
        """Cache a row group just read, dropping the least recently used beyond the byte budget."""
        self.reads += 1
        self._cache[key] = group
        self._cached_bytes += _nbytes(group)
        while len(self._cache) > 1 and self._cached_bytes > self.cache_bytes:
            self._cached_bytes -= _nbytes(self._cache.popitem(last=False)[1])
        return group

    def rows(self, indices: Sequence[int]) -> list[tuple[str, Row]]:
        """The rows at these global indices, in that order; each row group is decoded once."""
        wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (file, group) -> [(slot, row in group)]
        for slot, index in enumerate(indices):
            file_index, group, within = self._locate(index)
            wanted.setdefault((file_index, group), []).append((slot, within))
        out: list[tuple[str, Row] | None] = [None] * len(indices)
        for (file_index, group), places in wanted.items():
            table = self._row_group(file_index, group)
            path, first = self.files[file_index], self._group_starts[file_index][group]
            json_rows = self._json.get(file_index)
            if json_rows is not None:
                raws = [json_rows.decode(first + within, table[within]) for _, within in places]
            else:
                raws = [decode_row(raw) for raw in table.take([within for _, within in places]).to_pylist()]
            for (slot, within), raw in zip(places, raws):
                line = json_rows.line(first + within) if json_rows is not None else None
                row = parse_row(raw, file=path, index=first + within, line=line)
                out[slot] = (self._tags[file_index] + row_uid(row, path, first + within), row)
        return out  # type: ignore[return-value]

    def row(self, global_index: int) -> tuple[str, Row]:
        return self.rows([global_index])[0]

    def next_batch(self) -> list[tuple[str, Row]]:
        """The next batch, moving to the next epoch (a new order) when this one runs out."""
        remaining = self.num_rows - self.offset
        if remaining < self.batch_size and (self.drop_last or remaining == 0):
            self.epoch, self.offset = self.epoch + 1, 0
        indices = self.order(self.epoch, self.offset, self.offset + self.batch_size)
        self.offset += len(indices)
        return self.rows(indices)

    def __iter__(self) -> Iterator[list[tuple[str, Row]]]:
        """Batches without end, epoch after epoch (the caller decides when to stop)."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed:
            raise DataError(
                f"cannot resume: the saved position is for {counted(state['num_rows'], 'row')} with seed {state['seed']}, "
                f"these files hold {counted(self.num_rows, 'row')} with seed {self.seed}"
            )
        self.epoch, self.offset = state["epoch"], state["offset"]


def _nbytes(group: pa.Table | list[bytes]) -> int:
    return sum(map(len, group)) if isinstance(group, list) else group.nbytes


def rows_from_dicts(rows: Sequence[dict[str, Any]], source: str = "<generated>") -> list[tuple[str, Row]]:
    """Validate in-memory rows (e.g. generated tasks) as a dataset would."""
    out = []
    for index, raw in enumerate(rows):
        row = parse_row(raw, file=source, index=index)
        out.append((row_uid(row, source, index), row))
    return out
