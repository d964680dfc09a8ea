"""The flags the installed vLLM's API server accepts, read from its own argument parser.

vLLM renames and drops flags between releases (0.32 has no ``--swap-space``), so the extra flags a revision may
pass are the curated allow-list *intersected with* what this vLLM parses; a flag it would refuse costs a failed
start and a rollback otherwise. Reading the parser imports vLLM (seconds), so it runs once per vLLM version and
interpreter, in a subprocess, and the answer is kept in the data dir.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from pathlib import Path

from engine.revisions import VllmFlag

log = logging.getLogger("llmops.serving")

# Run with vLLM's interpreter: every --option of the OpenAI server's parser, whether it takes a value, its choices.
_PROBE = """
import importlib, json
from vllm.utils.argparse_utils import FlexibleArgumentParser
for name in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
    try:
        module = importlib.import_module(name)
        break
    except ImportError:
        continue
parser = module.make_arg_parser(FlexibleArgumentParser())
flags = {}
for action in parser._actions:
    for option in action.option_strings:
        if option.startswith("--"):
            flags[option] = {"takes_value": action.nargs != 0,
                             "choices": [str(c) for c in action.choices] if action.choices else None}
print("LLMOPS-FLAGS " + json.dumps(flags))
"""


class FlagProbeError(RuntimeError):
    """vLLM's argument parser could not be read; the message says why."""


def _parse(out: str) -> dict[str, VllmFlag]:
    for line in out.splitlines():
        if line.startswith("LLMOPS-FLAGS "):
            raw = json.loads(line.removeprefix("LLMOPS-FLAGS "))
            return {name: VllmFlag(name=name, takes_value=bool(v["takes_value"]),
                                   choices=tuple(v["choices"]) if v["choices"] else None) for name, v in raw.items()}
    raise FlagProbeError("vLLM's parser printed no flags")


class VllmFlags:
    """The installed vLLM's flags, probed once and cached by version in ``cache``."""

    def __init__(self, python: str, version: str | None, cache: Path, timeout_s: float = 180.0) -> None:
        self.python = python
        self.version = version
        self.cache = cache
        self.timeout_s = timeout_s
        self._flags: dict[str, VllmFlag] | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def _key(self) -> str:
        return f"{self.version}|{self.python}"

    def get(self) -> dict[str, VllmFlag] | None:
        """The flags (probing on the first call: seconds), or None with ``error`` saying why."""
        with self._lock:
            if self._flags is None and self.error is None:
                try:
                    self._flags = self._read_cache() or self._probe()
                except FlagProbeError as exc:
                    self.error = str(exc)
                    log.warning("cannot read vLLM's flags: %s", exc)
            return self._flags

    def _read_cache(self) -> dict[str, VllmFlag] | None:
        try:
            data = json.loads(self.cache.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != self._key():
            return None
        try:
            return _parse("LLMOPS-FLAGS " + json.dumps(data["flags"]))
        except (FlagProbeError, KeyError, TypeError, ValueError):
            return None

    def _probe(self) -> dict[str, VllmFlag]:
        try:
            done = subprocess.run([self.python, "-c", _PROBE], capture_output=True, text=True,
                                  timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FlagProbeError(f"running {self.python} failed: {exc}") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise FlagProbeError(f"vLLM's parser could not be loaded (exit {done.returncode}): {tail[0][:300]}")
        flags = _parse(done.stdout)
        try:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            self.cache.write_text(json.dumps({"key": self._key(), "flags": {
                f.name: {"takes_value": f.takes_value, "choices": list(f.choices) if f.choices else None}
                for f in flags.values()}}))
        except OSError as exc:  # probed again next time; nothing else depends on the file
            log.warning("could not keep vLLM's flags in %s: %s", self.cache, exc)
        return flags
