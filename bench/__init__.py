"""The project's benchmarks as one tool: ``python -m bench SCENARIO [--profile NAME] [--out DIR] [options]``.

Each scenario (bench/scenarios/) measures one thing with the real engine and vLLM, through the harness the tests
use (tests/testkit); a profile (bench/profiles.toml) says what machine and model it runs on and with which knobs;
every run writes ``run.json`` beside its results (date, commit, versions, the exact command line, the profile).
What the docs cite is kept, small, in bench/results/. ``python -m bench --help`` lists the scenarios."""
