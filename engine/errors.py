"""The engine's exception hierarchy: one small family per boundary, each message saying what to do."""

from __future__ import annotations

MAX_ID = 2**53 - 1  # ids and counts the API takes: exact in JSON numbers and within SQLite INTEGER (else a 500)


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


# --- settings and their store -------------------------------------------------------------------------------


class SettingsError(EngineError):
    """A settings write was refused; nothing was written."""


class InvalidSettingsError(SettingsError):
    """Values failed validation. ``errors`` lists each bad field and why (FastAPI's 422 shape)."""

    def __init__(self, errors: list[dict[str, object]]) -> None:
        self.errors = errors
        super().__init__(f"invalid settings: {self.describe()}")

    def fields(self) -> list[str]:
        out = []
        for e in self.errors:
            loc = e.get("loc")
            out.append(str(loc[-1]) if isinstance(loc, list | tuple) and loc else "?")
        return out

    def describe(self) -> str:
        """Each bad field and why, in one line."""
        return "; ".join(f"{f}: {e.get('msg')}" for f, e in zip(self.fields(), self.errors, strict=True))


class PreflightError(SettingsError):
    """Pre-flight found errors (the revision would not start, or not fit); ``errors`` in FastAPI's 422 shape."""

    def __init__(self, errors: list[dict[str, object]]) -> None:
        self.errors = errors
        super().__init__("pre-flight refused the settings: " + "; ".join(str(e["msg"]) for e in errors))


class StaleRevisionError(SettingsError):
    """The write named a base revision that is no longer the desired one."""

    def __init__(self, base: int, current: int | None) -> None:
        self.base = base
        self.current = current
        super().__init__(
            f"base revision {base} is stale: the desired revision is now {current}; "
            "read the settings again and re-apply your change on top of it"
        )


class RevisionNotFoundError(SettingsError):
    def __init__(self, revision: int) -> None:
        self.revision = revision
        super().__init__(f"revision {revision} does not exist; `llmops settings history` lists them")


# --- the database ---------------------------------------------------------------------------------------------


class DatabaseError(EngineError):
    """The engine's database could not be opened as it is."""


class UnsupportedDatabaseError(DatabaseError):
    """The database URL names neither SQLite nor PostgreSQL."""


class DatabaseUnavailableError(DatabaseError):
    """The database server could not be reached (it is down, restarting, or the URL is wrong)."""


class SchemaTooNewError(DatabaseError):
    """The database was written by a newer engine: its schema revision is not one this engine knows. Nothing
    was changed."""

    def __init__(self, where: str, found: list[str], newest: str | None) -> None:
        self.found = found
        self.newest = newest
        super().__init__(
            f"the database {where} is at schema revision {', '.join(found)}, which this engine does not know (the "
            f"newest it knows is {newest}): it was written by a newer llmops. Nothing was changed; run that newer "
            "version on it, or point this one at a database (or a backup) it made")


# --- the vLLM child process -----------------------------------------------------------------------------------


class ServingError(EngineError):
    """The serving controller could not do what was asked of a vLLM instance."""


class PortBusyError(ServingError):
    pass


class StrayProcessError(ServingError):
    """Processes of an earlier vLLM child survived SIGKILL; starting another would fight them for memory."""


class SandboxUnavailableError(ServingError):
    """Landlock cannot confine a vLLM child on this host (a kernel built without it, or with it turned off at
    boot): the sandbox of engine/vllm_sandbox.py cannot be made. The engine then starts vLLM unconfined and says so;
    vllm_sandbox=false says it is meant."""


# --- the /v1 gateway ------------------------------------------------------------------------------------------


class GatewayError(EngineError):
    """A /v1 request could not be served."""


class QueueFullError(GatewayError):
    pass


class QueueTimeoutError(GatewayError):
    pass


class UpstreamUnavailableError(GatewayError):
    pass


class OutOfScopeError(GatewayError):
    """A gateway key limited to other deployments asked for this one: for that key it does not exist (OpenAI's
    404 model_not_found)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"the model {model[:200]} does not exist for this key")
        self.model = model


# --- LoRA adapters ------------------------------------------------------------------------------------------------


class AdapterError(EngineError):
    """A LoRA adapter was refused, or is not there; nothing changed."""


class AdapterInvalidError(AdapterError):
    """An adapter does not fit its deployment (its folder, its config, its weights against the base model): HTTP
    422 naming ``field`` and the reason."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class AdapterConflictError(AdapterError):
    """The name is taken (by another adapter, a deployment or a served model name): HTTP 409."""


class AdapterNotFoundError(AdapterError):
    """No adapter of that name under the deployment: HTTP 404."""
