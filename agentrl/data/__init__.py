"""Rows and their parquet files. ``write_rows`` writes rows the way agentrl reads them (the
nested free-form fields as JSON text, small row groups, atomically): a plugin package's data
source uses it, as ``agentrl.write_rows``."""

from __future__ import annotations

from agentrl.data.io import write_rows
from agentrl.data.row import Row

__all__ = ["Row", "write_rows"]
