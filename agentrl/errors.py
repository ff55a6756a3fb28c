"""Every exception agentrl raises on purpose.

    AgentrlError
     ├── ConfigError          the composed config failed validation (all problems at once)
     ├── DataError            a dataset file or row is invalid (file, row index, field)
     ├── PluginError          an entry point failed to load, or two plugins share a name
     ├── EngineError          an inference engine failed
     │    ├── EngineUnavailable   no healthy server / transport failed after retries
     │    └── EngineTimeout       a request outlived its timeout
     ├── ToolError            a tool failed in a way the model should be told about
     │    └── ToolArgumentError   arguments did not match the tool's JSON schema
     ├── TrajectoryError      the token stream would lose alignment (ids/mask/logprobs)
     ├── EnvironmentFailure   a row's environment (its server or its code) failed: environment_error
     ├── CheckpointError      a checkpoint or run directory cannot be used to resume
     ├── WorkerDied           a trainer worker process ended (the step cannot complete)
     └── NotAvailable         a CLI command whose module is not part of this installation

Callers catch by what they can do about it: a config or data problem stops before compute is
spent; an engine problem may be retried on another server; a tool problem is fed back to the
model. Exceptions of the libraries underneath are wrapped with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "AgentrlError",
    "ConfigError",
    "DataError",
    "PluginError",
    "EngineError",
    "EngineUnavailable",
    "EngineTimeout",
    "ToolError",
    "ToolArgumentError",
    "TrajectoryError",
    "EnvironmentFailure",
    "CheckpointError",
    "WorkerDied",
    "NotAvailable",
]


class AgentrlError(Exception):
    """Base of every error agentrl raises on purpose."""


class ConfigError(AgentrlError):
    """The configuration is invalid. ``problems`` lists every (key, message) found."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        lines = [f"  {key}: {message}" for key, message in self.problems]
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"invalid configuration ({len(self.problems)} {noun}):\n" + "\n".join(lines))


class DataError(AgentrlError):
    """A dataset file or row is invalid; names the file, the row index and the field (and, in a
    JSON Lines file, the row's line: ``row 3 (line 4)``)."""

    def __init__(self, message: str, *, file: str | None = None, row: int | None = None, field: str | None = None,
                 line: int | None = None):
        self.message, self.file, self.row, self.field, self.line = message, file, row, field, line
        where = ", ".join(
            part
            for part in (
                f"file {file}" if file is not None else "",
                f"row {row}" + (f" (line {line})" if line is not None else "") if row is not None else "",
                f"field {field}" if field is not None else "",
            )
            if part
        )
        super().__init__(f"{where}: {message}" if where else message)


class PluginError(AgentrlError):
    """An entry point could not be loaded, or a plugin name is ambiguous."""


class EngineError(AgentrlError):
    """An inference engine failed to serve a request."""


class EngineUnavailable(EngineError):
    """No healthy engine could take the request (after retries)."""


class EngineTimeout(EngineError):
    """A request to an engine timed out."""


class ToolError(AgentrlError):
    """A tool call failed; the model is shown ``Error: <message>``, or ``shown`` when given (a
    library's own wording of a failed call, e.g. TRL's ``{'error': '...'}``)."""

    def __init__(self, *args: object, shown: str | None = None):
        super().__init__(*args)
        self.shown = shown


class ToolArgumentError(ToolError):
    """Tool-call arguments do not match the tool's JSON schema."""


class TrajectoryError(AgentrlError):
    """Appending would break the alignment of ids, mask and logprobs."""


class EnvironmentFailure(AgentrlError):
    """A row's environment failed (an OpenEnv server, a verifiers or TRL environment's code): the
    trajectory ends ``environment_error``, out of the loss, counted as ``env_errors/<kind>``."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class CheckpointError(AgentrlError):
    """A checkpoint or run directory is missing or inconsistent."""


class WorkerDied(AgentrlError):
    """A worker process of a trainer group ended (the step cannot complete)."""


class NotAvailable(AgentrlError):
    """A subcommand whose module is not part of this installation."""
