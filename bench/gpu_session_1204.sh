#!/usr/bin/env bash
# The H200 session of 2026-12-04 for issue 20, items 4 and 3, one engine throughout (local placement, the
# Llama-3-8B shape at 0.42 of the GPU, max_num_seqs 256 as its ceiling, sleep mode on as on every CUDA host):
#  item 4: for N = 128 and 32 at 2N clients, runs of >= 30 s, fresh prompts, lengths +-50 %:
#    the gateway's cap of N (no restart) against vLLM started beside it with N and the ceiling's CUDA graphs
#    (--max-cudagraph-capture-size 512: graphs, cap, cap, graphs), then the engine restarted with N (an apply of
#    max_num_seqs_ceiling N: vLLM's own graphs for N; restarted, restarted), then the ceiling back (an apply).
#    On 2026-12-03 the cap gave x1.44-1.56 a restart's throughput; vLLM sizes its graphs from max_num_seqs.
#  item 3: every start of this engine is estimated before it and recorded with what it took (cold first; the
#    restarts and the ceiling back are blue/green starts beside the serving instance); then a pause (utilization
#    0.95: nothing fits beside it, a warm start alone) and a bad revision twice (the old instance sleeps and is
#    woken). Events in cap/events-this.json.
# Staging as in ../shared/gpu/README.md (no Ray); start it detached and collect $O back to back (the machine is
# given back after 30 s without a call). Progress in $O/progress.txt; $O/DONE at the end.
set -x
. bench/gpu_prelude.sh
mark start
timeout 1560 python3 bench/gateway_overhead.py --out $O/cap --model /tmp/m8b --load-format dummy --utilization 0.42 \
  --max-num-seqs 256 --max-model-len 4096 --input-len 200 --output-len 128 --range-ratio 0.5 --plans-only \
  --cap-vs-restart 128 32 --cap-prompts 2400 1200 --cap-runs 4 \
  --after gpu_memory_utilization=0.95 --after max_model_len=999999 --after max_model_len=999999 > $O/cap.log 2>&1
mark cap done rc=$?
cp /tmp/gateway-overhead-*/engine-*.log $O/ 2>/dev/null
echo done > $O/DONE
