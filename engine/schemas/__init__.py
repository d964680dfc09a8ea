"""Wire models of the engine's HTTP API: what the routes return and the console's client parses.

Pydantic only: the console imports these without the engine's SQLite, NVML or vLLM code.
"""

from engine.schemas.common import Build, EngineState

__all__ = ["Build", "EngineState"]
