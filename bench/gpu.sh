#!/usr/bin/env bash
# The H200 machine's entry to the benchmarks: its environment, then `python3 -m bench` with the h200 profile
# (bench/profiles.toml: vLLM 0.26.0 from /tmp/site, VLLM_USE_FLASHINFER_SAMPLER=0, the 8B-shaped model made in
# /tmp/m8b where it is missing, results under /var/tmp/out). Nothing here is dated: a session is its arguments.
# Staging first, as ../shared/gpu/README.md says (the .gpu/ parts on the machine); from the project's root:
#
#   bash .gpu/install.sh                       # once per fresh machine: vLLM's wheels into /tmp/site
#   setsid nohup bash bench/gpu.sh session --scenarios gateway-overhead,apply-gap > /var/tmp/session.out 2>&1 &
#   bash bench/gpu.sh capacity-archs --only qwen3-4b qwen3-30b-a3b      # or one scenario in the foreground
#
# then collect /var/tmp/out back to back (each call: `[ -d /var/tmp/out ] || { echo gone; exit 9; }`, then copy
# what is there under $OUT), until /var/tmp/out/DONE. LLMOPS_BENCH_PROFILE picks another profile;
# LLMOPS_BENCH_COMMIT records the commit where the machine's copy of .git is not this tree's.
set -eu
cd "$(dirname "$0")/.."
export LLMOPS_BENCH_PROFILE=${LLMOPS_BENCH_PROFILE:-h200}
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
if ! python3 -c "import vllm" 2>/dev/null; then
  echo "vLLM is not importable: stage it first (bash .gpu/install.sh, ../shared/gpu/README.md)" >&2
  exit 2
fi
exec python3 -m bench "$@"
