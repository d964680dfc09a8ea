"""``python -m bench``: the scenario list, or one scenario run with its profile, its output folder and its record."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import sys
import textwrap
import time

from bench.base import Help, RunRecord, apply_profile, common_options, ray_head
from bench.profiles import DEFAULT, ProfileError, get, load
from bench.scenarios import SCENARIOS

USAGE = """usage: python -m bench SCENARIO [--profile NAME] [--out DIR] [--ray] [scenario options]
       python -m bench SCENARIO --help"""


def overview() -> str:
    """The usage line, every scenario with one line on what it measures, and the profiles."""
    width = max(len(name) for name in SCENARIOS) + 2
    lines = [USAGE, "", "The project's benchmarks, one command with named scenarios; each run writes run.json (date, "
             "commit, versions,", "the command line, the profile) beside its results. What the docs cite is kept in "
             "bench/results/.", "", "scenarios:"]
    for s in SCENARIOS.values():
        text = f"{s.summary} [starts: {s.needs}]"
        wrapped = textwrap.wrap(text, 118 - width - 2) or [""]
        lines.append(f"  {s.name.ljust(width)}{wrapped[0]}")
        lines += [" " * (width + 2) + more for more in wrapped[1:]]
    lines += ["", f"profiles (bench/profiles.toml; default {DEFAULT}, or $LLMOPS_BENCH_PROFILE):"]
    for name, profile in load().items():
        wrapped = textwrap.wrap(profile.description, 118 - width - 2)
        lines.append(f"  {name.ljust(width)}{wrapped[0]}")
        lines += [" " * (width + 2) + more for more in wrapped[1:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(overview())
        return 0
    name, rest = argv[0], argv[1:]
    scenario = SCENARIOS.get(name)
    if scenario is None:
        near = difflib.get_close_matches(name, list(SCENARIOS), n=3)
        print(f"{USAGE}\npython -m bench: no scenario {name!r}" + (f" (did you mean {', '.join(near)}?)" if near
              else "; `python -m bench --help` lists them"), file=sys.stderr)
        return 2
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--profile")
    try:
        profile = get(pre.parse_known_args(rest)[0].profile)
    except ProfileError as exc:
        print(f"python -m bench {name}: {exc}", file=sys.stderr)
        return 2
    profile.apply_env()
    module = scenario.load()
    p = argparse.ArgumentParser(prog=f"python -m bench {name}", description=module.__doc__, formatter_class=Help)
    common_options(p)
    module.add_arguments(p)
    applied = apply_profile(p, name, profile)
    p.epilog = (f"Profile {profile.name} (bench/profiles.toml) sets: " + ", ".join(f"{k}={v}" for k, v in
                applied.items()) if applied else f"Profile {profile.name} sets none of these options.")
    a = p.parse_args(rest)
    root = profile.results_root(time.strftime("%Y-%m-%d"))
    a.out = (a.out or (root if name == "session" else root / name)).absolute()
    a.out.mkdir(parents=True, exist_ok=True)
    a.profile = profile.name
    record = RunRecord.begin(name, argv, profile, applied, a, a.out)
    print(f"python -m bench {name}: profile {profile.name}, results in {a.out}", flush=True)
    outcome, rc = "error", 1
    try:
        if profile.model is not None and getattr(a, "model", None) == profile.model:
            profile.ensure_model(a.out / "model.log")
        with ray_head(profile, a.out) if a.ray else contextlib.nullcontext():
            rc = int(module.run(a) or 0)
        outcome = "done" if rc == 0 else "failed"
    except KeyboardInterrupt:
        outcome, rc = "interrupted", 130
        raise
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
        outcome = "done" if rc == 0 else f"failed: {exc.code}"
        raise
    finally:
        record.end(outcome, rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
