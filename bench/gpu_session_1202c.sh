#!/usr/bin/env bash
# After bench/gpu_session_1202b.sh's cap runs: the gateway against direct vLLM on the one-node Ray cluster again, with
# the direct path at the address the node's actor chose (the first run sent its direct runs to the launch arguments'
# port, where nothing listened). Results under $O/ray-gw2.
set -x
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
O=${O:-/var/tmp/out}; mkdir -p $O
T0=$(date +%s); mark() { echo "c $(( $(date +%s) - T0 )) s: $*" >> $O/progress.txt; }
python3 -m ray.scripts.scripts stop --force > $O/ray-stop0.log 2>&1
python3 -m ray.scripts.scripts start --head --num-gpus 1 --disable-usage-stats --include-dashboard false \
  --object-store-memory 2000000000 > $O/ray-start2.log 2>&1
mark ray started
LLMOPS_RAY_ADDRESS=auto timeout 560 python3 bench/gateway_overhead.py --out $O/ray-gw2 --model /tmp/m8b \
  --load-format dummy --utilization 0.85 --max-num-seqs 256 --max-model-len 4096 --concurrency 64 256 \
  --input-len 200 --output-len 128 --prompts-per-client 8 --min-prompts 1792 \
  --plan-probe max_num_seqs=128 --plan-probe max_model_len=8192 --plan-probe gpu_memory_utilization=0.9 \
  > $O/ray-gw2.log 2>&1
mark ray gateway 2 done
python3 -m ray.scripts.scripts stop --force > $O/ray-stop2.log 2>&1
echo done > $O/DONE2
