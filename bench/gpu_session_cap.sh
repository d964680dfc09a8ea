#!/usr/bin/env bash
# The next H200 session for issue 20 item 4 (after 2026-12-03, where the cap beat vLLM restarted with N by ×1.44-1.56,
# one run each, the restarted instance's first after a 32-prompt warm-up): the gateway's cap of N against vLLM
# restarted with N, N = 128 and 32 at 2N clients, local placement, both instances warmed alike at the level's own
# clients (bench/gateway_overhead.py), then restarted, cap, cap, restarted, each ≥ 30 s, fresh prompts, lengths
# ±50 %; the restarted instances' logs kept (their start phases: what the ceiling costs). ~10 minutes of GPU time
# after staging (../shared/gpu/README.md). Start it detached; collect $O back to back; $O/DONE at the end.
set -x
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
O=${O:-/var/tmp/out}; mkdir -p $O
T0=$(date +%s); mark() { echo "$(( $(date +%s) - T0 )) s: $*" >> $O/progress.txt; }
python3 .gpu/make_shape_model.py /tmp/m8b > $O/model.log 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > $O/gpu.txt
mark start
timeout 1100 python3 bench/gateway_overhead.py --out $O/cap --model /tmp/m8b --load-format dummy --utilization 0.42 \
  --max-num-seqs 256 --max-model-len 4096 --input-len 200 --output-len 128 --range-ratio 0.5 --plans-only \
  --cap-vs-restart 128 32 --cap-prompts 2800 1400 --cap-runs 4 > $O/cap.log 2>&1
mark cap done rc=$?
echo done > $O/DONE
