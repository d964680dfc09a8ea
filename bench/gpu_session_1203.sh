#!/usr/bin/env bash
# The H200 session of 2026-12-03 (after the sixth run: the gateway on Ray 1.008 of direct at 64 clients, 0.924 at
# 256, with direct runs 9.6 % apart among themselves). In order of what is left:
#  1. on Ray (`ray start --head --num-gpus 1`): 256 clients, direct, gateway, gateway, direct, ≥ 30 s a run, fresh
#     prompts, lengths drawn ±50 % around 200 in / 128 out (--range-ratio 0.5: fixed lengths keep a closed loop of
#     256 clients in waves of prefill and decode, a different wave each run); then the gateway's cap at N = 128 and
#     32 against vLLM restarted with N, at 2N clients (issue 20 item 4);
#  2. capacity of Qwen3-4B (dense GQA) and Qwen3-30B-A3B (MoE), two starts each (issue 20 item 2);
#  3. the same 256-client runs with local placement: is what is left of the gap Ray's or the relay's?
# Every engine's events (its starts' ETAs against what they took, issue 20 item 3) go to events-this.json.
# Staging as in ../shared/gpu/README.md; start it detached and collect $O back to back (the machine is given back
# after 30 s without a call). Progress in $O/progress.txt; $O/DONE at the end.
set -x
. bench/gpu_prelude.sh
mark start
common="--model /tmp/m8b --load-format dummy --utilization 0.42 --max-num-seqs 256 --max-model-len 4096
  --input-len 200 --output-len 128 --range-ratio 0.5 --prompts-per-client 12 --min-prompts 2000 --concurrency 256"
python3 -m ray.scripts.scripts start --head --num-gpus 1 --disable-usage-stats --include-dashboard false \
  --object-store-memory 2000000000 > $O/ray-start.log 2>&1
mark ray started rc=$?
LLMOPS_RAY_ADDRESS=auto timeout 1000 python3 bench/gateway_overhead.py --out $O/ray $common \
  --cap-vs-restart 128 32 --cap-prompts 2800 1400 --cap-runs 2 > $O/ray.log 2>&1
mark ray and cap done rc=$?
python3 -m ray.scripts.scripts stop --force > $O/ray-stop.log 2>&1
OUT=$O/capacity ONLY="qwen3-4b qwen3-30b-a3b" BUDGET_S=420 PAIR_S=200 bash bench/gpu_capacity_archs.sh \
  > $O/capacity.out 2>&1
mark capacity done
timeout 500 python3 bench/gateway_overhead.py --out $O/local $common > $O/local.log 2>&1
mark local done rc=$?
echo done > $O/DONE
