"""Benchmark the row reader: shuffled batches from a large parquet file, time and memory.

    python -m agentrl_benchmarks.data_reader [--rows 300000] [--batch-size 256] [--row-group-size 1024] [--cache-mib 256]

Writes a synthetic file of GSM8K-sized rows (about 800 bytes each, hardly compressible, in chunks, so the writer
stays small too), then times ``RowDataset.next_batch`` shuffled and in order. Prints one JSON
object: seconds per batch, row groups decoded per batch, the Arrow bytes the row-group cache
holds and how much the process's resident memory grew.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from agentrl_benchmarks._scratch import scratch_dir


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def _rows(start: int, n: int) -> list[dict]:
    rng = random.Random(start)  # text that compresses like prose does not: 600 hex digits a row
    return [
        {
            "data_source": "bench/synthetic",
            "prompt": [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": rng.randbytes(300).hex()}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i, "split": "train", "tools_kwargs": '{"calculator": {"create_kwargs": {}}}'},
            "agent_name": "tool_agent",
        }
        for i in range(start, start + n)
    ]


def write_synthetic(path: Path, rows: int, row_group_size: int) -> None:
    chunk = 10_000
    first = pa.Table.from_pylist(_rows(0, min(chunk, rows)))
    with pq.ParquetWriter(path, first.schema) as writer:
        writer.write_table(first, row_group_size=row_group_size)
        for start in range(chunk, rows, chunk):
            writer.write_table(pa.Table.from_pylist(_rows(start, min(chunk, rows - start)), schema=first.schema), row_group_size=row_group_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentrl_benchmarks.data_reader", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--row-group-size", type=int, default=1024)
    parser.add_argument("--cache-mib", type=int, default=256)
    args = parser.parse_args(argv)

    import torch  # noqa: F401  (imported before measuring: the shuffle uses it, and it is large)

    from agentrl.data.dataset import RowDataset

    with scratch_dir("data-reader") as work:
        path = work / "rows.parquet"
        started = time.perf_counter()
        write_synthetic(path, args.rows, args.row_group_size)
        write_s = time.perf_counter() - started
        base = _rss_mib()
        started = time.perf_counter()
        dataset = RowDataset([path], batch_size=args.batch_size, seed=0, cache_bytes=args.cache_mib << 20)
        dataset.next_batch()  # draws the epoch's permutation
        first_s = time.perf_counter() - started
        reads, started = dataset.reads, time.perf_counter()
        for _ in range(args.batches):
            dataset.next_batch()
        shuffled_s = (time.perf_counter() - started) / args.batches
        result = {
            "rows": args.rows,
            "file_mib": round(path.stat().st_size / 2**20, 1),
            "row_groups": pq.ParquetFile(path).metadata.num_row_groups,
            "write_s": round(write_s, 2),
            "first_batch_s": round(first_s, 3),
            "shuffled_batch_s": round(shuffled_s, 4),
            "row_groups_decoded_per_batch": round((dataset.reads - reads) / args.batches, 1),
            "cache_arrow_mib": round(dataset._cached_bytes / 2**20, 1),
            "rss_growth_mib": round(_rss_mib() - base, 1),
        }
        ordered = RowDataset([path], batch_size=args.batch_size, shuffle=False, cache_bytes=args.cache_mib << 20)
        started = time.perf_counter()
        for _ in range(args.batches):
            ordered.next_batch()
        result["in_order_batch_s"] = round((time.perf_counter() - started) / args.batches, 4)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
