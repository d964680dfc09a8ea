"""The ``llmops`` command line: run the engine and the console, build the demo model, manage settings and tokens."""

from engine.cli.main import main

__all__ = ["main"]
