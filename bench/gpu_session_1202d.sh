#!/usr/bin/env bash
# The third H200 session of 2026-12-02, on a fresh machine, one long run collected back to back:
# 1. the engine as the driver of a one-node Ray cluster, one 8B-shaped instance at 0.42 started with max_num_seqs
#    256 as its ceiling: the gateway against direct vLLM at 64 and 256 clients (direct, gateway, gateway, direct;
#    fresh prompts; ≥ 2,000 prompts and 12 a client so that each run lasts ≥ 30 s), three plans; then the gateway's
#    cap of N = 32 and 128 against vLLM started with N beside it, at 2N clients (restarted, cap) (issue 20 item 4);
# 2. Ray stopped, the GPU free: the capacity pair left from the morning (Qwen3-30B-A3B, Qwen3-4B; issue 20 item 2).
# Progress in $O/progress.txt; $O/DONE at the end.
set -x
. bench/gpu_prelude.sh
git log -1 --format='%h %cI' > $O/commit.txt 2>&1 || true
mark start
python3 -m ray.scripts.scripts start --head --num-gpus 1 --disable-usage-stats --include-dashboard false \
  --object-store-memory 2000000000 > $O/ray-start.log 2>&1
mark ray started
LLMOPS_RAY_ADDRESS=auto timeout 1300 python3 bench/gateway_overhead.py --out $O/gw --model /tmp/m8b \
  --load-format dummy --utilization 0.42 --max-num-seqs 256 --max-model-len 4096 --concurrency 64 256 \
  --input-len 200 --output-len 128 --prompts-per-client 12 --min-prompts 2000 ${RUNS:-} \
  --plan-probe max_num_seqs=128 --plan-probe max_model_len=8192 --plan-probe gpu_memory_utilization=0.5 \
  --cap-vs-restart 128 32 --cap-prompts 2800 1400 --cap-runs 2 > $O/gw.log 2>&1
mark gateway and cap done rc=$?
python3 -m ray.scripts.scripts stop --force > $O/ray-stop.log 2>&1
for i in $(seq 60); do
  used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1 | tr -d ' ')
  [ "${used:-0}" -lt 2000 ] && break; sleep 2
done
mark gpu free "${used:-?}" MiB
OUT=$O/capacity ONLY="qwen3-30b-a3b qwen3-4b" BUDGET_S=500 bash bench/gpu_capacity_archs.sh > $O/capacity.out 2>&1
mark capacity done
echo done > $O/DONE
