#!/usr/bin/env bash
# What the H200 session of 2026-12-04 (bench/gpu_session_1204.sh, docs/gpu-validation.md "Eighth run") left, for the
# next session (~17 minutes of GPU time after staging), one engine throughout (local placement, the Llama-3-8B shape
# at 0.42, max_num_seqs 256 as its ceiling, sleep mode on):
#  item 4: N = 32 at 64 clients: graphs, cap, cap, graphs, then the engine restarted with 32, twice; 1,400 prompts
#    a run (the 2026-12-04 runs of 1,200 took 29.6-30.1 s at ~5,100 tok/s; >= 30 s is asked);
#  item 3: the starts of every kind the H200 makes, each estimated at its launch: the first (cold), blue/green
#    beside the serving instance (the restart with 32, the ceiling back), a bridge twice (0.42 -> 0.85 does not fit
#    beside the old instance: a bridge at 0.13, the new one beside it; then a new max_model_len at 0.85), a pause
#    (0.95: nothing fits beside it, a start alone with its compile cache warm), two bad revisions (the old instance
#    sleeps, the new one fails, the old one is woken).
# Staging as in ../shared/gpu/README.md (no Ray). Start it detached (setsid nohup) and collect $O back to back: the
# machine is given back 30 s after a call ends, so every collection call begins with
# `[ -d /var/tmp/out ] || { echo gone; exit 9; }` (on 2026-12-04 a call found a bare machine and waited out its
# limit, which spent the rest of the session). Progress in $O/progress.txt; $O/DONE at the end.
set -x
. bench/gpu_prelude.sh
mark start
timeout 1500 python3 bench/gateway_overhead.py --out $O/cap --model /tmp/m8b --load-format dummy --utilization 0.42 \
  --max-num-seqs 256 --max-model-len 4096 --input-len 200 --output-len 128 --range-ratio 0.5 --plans-only \
  --cap-vs-restart 32 --cap-prompts 1400 --cap-runs 4 \
  --after gpu_memory_utilization=0.85 --after max_model_len=8192 --after gpu_memory_utilization=0.95 \
  --after max_model_len=999999 --after max_model_len=999999 > $O/cap.log 2>&1
mark cap done rc=$?
cp /tmp/gateway-overhead-*/engine-*.log $O/ 2>/dev/null
echo done > $O/DONE
