#!/usr/bin/env bash
# The second H200 session of 2026-12-02, again on a fresh machine (the first lost its machine after the cap's first
# run, and its direct runs on Ray had gone to the launch arguments' port, where nothing listened): the engine as the
# driver of a one-node Ray cluster, one 8B-shaped instance at 0.42 started with max_num_seqs 256 as its ceiling: the
# gateway against direct vLLM at 64 and 256 clients (direct, gateway, gateway, direct; fresh prompts), three plans;
# (CAP=" ": the gateway runs alone) then the gateway's cap of N = 128 against vLLM started with 128 beside it at 256 clients (one run each).
set -x
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
O=${O:-/var/tmp/out}; mkdir -p $O
T0=$(date +%s); mark() { echo "$(( $(date +%s) - T0 )) s: $*" >> $O/progress.txt; }
python3 .gpu/make_shape_model.py /tmp/m8b > $O/model.log 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > $O/gpu.txt
mark start
python3 -m ray.scripts.scripts start --head --num-gpus 1 --disable-usage-stats --include-dashboard false \
  --object-store-memory 2000000000 > $O/ray-start.log 2>&1
mark ray started
LLMOPS_RAY_ADDRESS=auto timeout 900 python3 bench/gateway_overhead.py --out $O/gw --model /tmp/m8b \
  --load-format dummy --utilization 0.42 --max-num-seqs 256 --max-model-len 4096 --concurrency 64 256 \
  --input-len 200 --output-len 128 --prompts-per-client 10 --min-prompts 1792 ${RUNS:-} \
  --plan-probe max_num_seqs=128 --plan-probe max_model_len=8192 --plan-probe gpu_memory_utilization=0.5 \
  ${CAP:---cap-vs-restart 128 --cap-prompts 2000 --cap-runs 2} > $O/gw.log 2>&1
mark gateway and cap done
python3 -m ray.scripts.scripts stop --force > $O/ray-stop.log 2>&1
echo done > $O/DONE
