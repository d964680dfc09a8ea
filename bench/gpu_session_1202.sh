#!/usr/bin/env bash
# One H200 session for issues 18-20 (2026-12-02), in the background of a device call; results under $O.
#   1. capacity on five architectures (bench/gpu_capacity_archs.sh, ~12 min; its logs become test fixtures)
#   2. two 8B-shaped deployments at 0.45 each on the one GPU, 32 streaming clients on each, an apply of one
#   3. the engine as a driver of a one-node Ray cluster: the gateway against direct vLLM at 64 and 256 clients
#      (fresh prompts each run, direct/gateway/gateway/direct), and the plans it chooses for three changes
# Each step is bounded by timeout; a step that fails leaves its log and the next one runs.
set -x
. bench/gpu_prelude.sh
python3 -c "import vllm, ray, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__)" > $O/versions.txt 2>&1
mark start
if [ -z "${SKIP_CAPACITY:-}" ]; then
  OUT=$O/capacity BUDGET_S=${CAPACITY_BUDGET_S:-780} timeout 840 bash bench/gpu_capacity_archs.sh > $O/capacity.out 2>&1
  mark capacity done
fi
timeout 480 python3 bench/deployments_side_by_side.py --out $O/deploy --model /tmp/m8b --load-format dummy \
  --values gpu_memory_utilization=0.45 max_model_len=4096 max_num_seqs=128 --apply max_model_len=8192 --bad \
  --clients 32 --max-tokens 64 --window 30 > $O/deploy.log 2>&1
mark deployments done
python3 -m ray.scripts.scripts start --head --num-gpus 1 --disable-usage-stats --include-dashboard false \
  --object-store-memory 2000000000 > $O/ray-start.log 2>&1
mark ray started
LLMOPS_RAY_ADDRESS=auto timeout 600 python3 bench/gateway_overhead.py --out $O/ray-gw --model /tmp/m8b \
  --load-format dummy --utilization 0.85 --max-num-seqs 256 --max-model-len 4096 --concurrency 64 256 \
  --input-len 200 --output-len 128 --prompts-per-client 20 --min-prompts 2048 \
  --plan-probe max_num_seqs=128 --plan-probe max_model_len=8192 --plan-probe gpu_memory_utilization=0.9 \
  > $O/ray-gw.log 2>&1
mark ray gateway done
python3 -m ray.scripts.scripts stop --force > $O/ray-stop.log 2>&1
echo done > $O/DONE
