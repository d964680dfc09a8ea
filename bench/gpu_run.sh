#!/usr/bin/env bash
# One H200 session for issues 13 and 14, run in the background of a device call (see docs/gpu-validation.md):
# an apply under 16 streaming clients through a bridge, a forced bad revision, a pause with sleep mode and a bad
# revision after it; then the gateway's overhead at 256, 512 and 64 clients. Results in /var/tmp/out.
set -x
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
O=/var/tmp/out; mkdir -p $O
python3 .gpu/make_shape_model.py /tmp/m8b > $O/model.log 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > $O/gpu.txt
python3 -c "import vllm; print(vllm.__version__)" > $O/versions.txt 2>&1
timeout 960 python3 bench/apply_gap.py --out $O/apply --model /tmp/m8b --load-format dummy \
  --base gpu_memory_utilization=0.85 max_num_seqs=256 max_model_len=4096 \
  --apply max_num_seqs=128 --apply-bad max_model_len=999999 --apply-pause gpu_memory_utilization=0.95 \
  --order apply,apply-bad,apply-pause,apply-bad > $O/apply.log 2>&1
timeout 720 python3 bench/gateway_overhead.py --out $O/gw --model /tmp/m8b --load-format dummy --utilization 0.85 \
  --max-num-seqs 256 --max-model-len 4096 --concurrency 256 512 64 --input-len 200 --output-len 128 \
  --prompts-per-client 2 --min-prompts 256 > $O/gw.log 2>&1
echo done > $O/DONE
