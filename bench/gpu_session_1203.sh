#!/usr/bin/env bash
# The next H200 session (after 2026-12-02's sixth run: the gateway on Ray 1.008 of direct at 64 clients, 0.924 at
# 256): is the cost at 256 Ray's or the relay's? The same bench twice on the same machine, local placement then Ray
# (256 clients, two rounds of direct, gateway, gateway, direct each, ≥ 35 s a run, fresh prompts), then on Ray the
# cap at N = 128 and 32 against vLLM restarted with N (issue 20 item 4), then the Qwen3 capacity pair (item 2).
# Staging as in ../shared/gpu/README.md; start it detached and collect $O back to back (the machine is given back
# after 30 s without a call). Progress in $O/progress.txt; $O/DONE at the end.
set -x
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
O=${O:-/var/tmp/out}; mkdir -p $O
T0=$(date +%s); mark() { echo "$(( $(date +%s) - T0 )) s: $*" >> $O/progress.txt; }
python3 .gpu/make_shape_model.py /tmp/m8b > $O/model.log 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > $O/gpu.txt
mark start
common="--model /tmp/m8b --load-format dummy --utilization 0.42 --max-num-seqs 256 --max-model-len 4096
  --input-len 200 --output-len 128 --prompts-per-client 12 --min-prompts 2000"
timeout 700 python3 bench/gateway_overhead.py --out $O/local $common --concurrency 256 --rounds 2 > $O/local.log 2>&1
mark local done rc=$?
python3 -m ray.scripts.scripts start --head --num-gpus 1 --disable-usage-stats --include-dashboard false \
  --object-store-memory 2000000000 > $O/ray-start.log 2>&1
LLMOPS_RAY_ADDRESS=auto timeout 1300 python3 bench/gateway_overhead.py --out $O/ray $common --concurrency 256 \
  --rounds 2 --cap-vs-restart 128 32 --cap-prompts 2800 1400 --cap-runs 2 > $O/ray.log 2>&1
mark ray and cap done rc=$?
python3 -m ray.scripts.scripts stop --force > $O/ray-stop.log 2>&1
OUT=$O/capacity ONLY="qwen3-30b-a3b qwen3-4b" BUDGET_S=500 bash bench/gpu_capacity_archs.sh > $O/capacity.out 2>&1
mark capacity done
echo done > $O/DONE
