#!/usr/bin/env bash
# The second H200 session of 2026-12-02, in the background of a device call; results under $O.
#   1. the engine as the driver of a one-node Ray cluster, one 8B-shaped instance at 0.42 of the GPU started with
#      max_num_seqs 256 as its ceiling: the gateway against direct vLLM at 64 and 256 clients (direct, gateway,
#      gateway, direct; fresh prompts each run), the plans it chooses for three changes (issue 19); then the
#      gateway's cap of N = 32 and 128 (no restart) against vLLM started with N beside it, at 2N clients (issue 20 #4)
#   2. capacity on the two architectures the last session's budget cut (Qwen3-30B-A3B, Qwen3-4B; issue 20 #2)
# Each step is bounded by timeout; a step that fails leaves its log and the next one runs.
set -x
. bench/gpu_prelude.sh
python3 -c "import vllm, ray, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__)" > $O/versions.txt 2>&1
git log -1 --format=%h > $O/commit.txt 2>/dev/null
mark start
python3 -m ray.scripts.scripts start --head --num-gpus 1 --disable-usage-stats --include-dashboard false \
  --object-store-memory 2000000000 > $O/ray-start.log 2>&1
mark ray started
LLMOPS_RAY_ADDRESS=auto timeout ${GW_TIMEOUT_S:-1260} python3 bench/gateway_overhead.py --out $O/ray-gw --model /tmp/m8b \
  --load-format dummy --utilization 0.42 --max-num-seqs 256 --max-model-len 4096 --concurrency 64 256 \
  --input-len 200 --output-len 128 --prompts-per-client 8 --min-prompts 1792 \
  --plan-probe max_num_seqs=128 --plan-probe max_model_len=8192 --plan-probe gpu_memory_utilization=0.5 \
  --cap-vs-restart 32 128 --cap-prompts 1300 2000 > $O/ray-gw.log 2>&1
mark ray gateway and cap done
python3 -m ray.scripts.scripts stop --force > $O/ray-stop.log 2>&1
if [ -z "${SKIP_CAPACITY:-}" ]; then
  ONLY="qwen3-30b-a3b qwen3-4b" OUT=$O/capacity BUDGET_S=${CAPACITY_BUDGET_S:-420} timeout 480 \
    bash bench/gpu_capacity_archs.sh > $O/capacity.out 2>&1
  mark capacity done
fi
echo done > $O/DONE
