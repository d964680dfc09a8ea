#!/usr/bin/env bash
# Second H200 session of 2026-12-04: the starts of every kind the engine makes there, each estimated at its launch
# (issue 20 item 3), after bench/gpu_session_1205.sh's machine was taken back between two collections (its N = 32
# runs came back; its applies did not). One engine (local placement, the Llama-3-8B shape at 0.42, max_num_seqs
# 256, sleep mode on): the first start (cold), a bridge twice (0.42 -> 0.85 does not fit beside the old instance;
# then a new max_model_len at 0.85), a pause (0.95: nothing fits beside it, a start alone over the key of the start
# before it: expected warm, it compiled), two bad revisions (the old instance sleeps, the new one fails, the old one is woken). The engine's events
# are written after each apply. Progress in $O/progress.txt; $O/DONE at the end.
set -x
. bench/gpu_prelude.sh
mark start
timeout 1000 python3 bench/gateway_overhead.py --out $O/eta --model /tmp/m8b --load-format dummy --utilization 0.42 \
  --max-num-seqs 256 --max-model-len 4096 --plans-only \
  --after gpu_memory_utilization=0.85 --after max_model_len=8192 --after gpu_memory_utilization=0.95 \
  --after max_model_len=999999 --after max_model_len=999999 > $O/eta.log 2>&1
mark eta done rc=$?
cp /tmp/gateway-overhead-*/engine-*.log $O/ 2>/dev/null
echo done > $O/DONE
