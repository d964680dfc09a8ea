"""Machine and model profiles, read from bench/profiles.toml: what a measurement runs on (the vLLM build, the
model, the environment it needs) and the knobs it runs with, as data. A profile fills in the defaults of a
scenario's options; the command line still wins. Its description goes into every run's record, so a figure says
what it was measured on."""

from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILES = Path(__file__).resolve().parent / "profiles.toml"
REPO = Path(__file__).resolve().parent.parent
DEFAULT = "cpu-2core"  # where LLMOPS_BENCH_PROFILE names none
KEYS = {"description", "results", "gpu", "env", "model", "make_model", "ray_gpus", "ray_object_store_bytes",
        "session", "options", "scenarios"}
SESSION_ONLY = {"timeout_s"}  # keys of a scenario's table that are not its options


class ProfileError(ValueError):
    """A profile that does not exist, or one that bench/profiles.toml gets wrong."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    results: str
    gpu: bool = False
    env: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    make_model: list[str] = field(default_factory=list)
    ray_gpus: int = 0
    ray_object_store_bytes: int = 2_000_000_000
    session: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    scenarios: dict[str, dict[str, Any]] = field(default_factory=dict)

    def defaults(self, scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The defaults this profile gives ``scenario``'s options: those every scenario may take where it has the
        option (the model, ``options``), and the scenario's own (which it must have)."""
        general = dict(self.options)
        if self.model is not None:
            general.setdefault("model", self.model)
        own = {k.replace("-", "_"): v for k, v in self.scenarios.get(scenario, {}).items() if k not in SESSION_ONLY}
        return general, own

    def timeout_s(self, scenario: str) -> float | None:
        """A session's time limit for ``scenario``, if the profile sets one."""
        value = self.scenarios.get(scenario, {}).get("timeout_s")
        return float(value) if value is not None else None

    def results_root(self, date: str) -> Path:
        return Path(self.results.format(date=date, profile=self.name)).expanduser()

    def apply_env(self) -> None:
        """Set the profile's environment here, for this process and every process it starts; a PYTHONPATH also
        reaches this process's own imports (vLLM's version is read from where the children will import it)."""
        for key, value in self.env.items():
            os.environ[key] = value.format(repo=REPO)
            if key == "PYTHONPATH":
                for entry in reversed(os.environ[key].split(os.pathsep)):
                    if entry and entry not in sys.path:
                        sys.path.insert(0, entry)

    def ensure_model(self, log: Path) -> None:
        """Make the profile's model where it is missing (the 8B shape on a fresh GPU machine), its output in
        ``log``."""
        import subprocess

        if not self.model or not self.make_model or Path(self.model).exists():
            return
        with log.open("wb") as out:
            subprocess.run(self.make_model, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=True)


def load(path: Path = PROFILES) -> dict[str, Profile]:
    """Every profile of ``path``, by name."""
    with path.open("rb") as f:
        raw = tomllib.load(f)
    profiles = {}
    for name, table in raw.items():
        unknown = set(table) - KEYS
        if unknown:
            raise ProfileError(f"{path.name}: profile {name} has unknown keys {sorted(unknown)} "
                               f"(known: {sorted(KEYS)})")
        try:
            profiles[name] = Profile(name=name, **table)
        except TypeError as exc:
            raise ProfileError(f"{path.name}: profile {name}: {exc}") from exc
    return profiles


def get(name: str | None) -> Profile:
    """The profile ``name`` (default: LLMOPS_BENCH_PROFILE, else cpu-2core)."""
    name = name or os.environ.get("LLMOPS_BENCH_PROFILE") or DEFAULT
    profiles = load()
    if name not in profiles:
        raise ProfileError(f"no profile {name!r} in {PROFILES.name}; there are: {', '.join(sorted(profiles))}")
    return profiles[name]
