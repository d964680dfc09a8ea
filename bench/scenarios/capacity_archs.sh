#!/usr/bin/env bash
# The starts of `python -m bench capacity-archs` (bench/scenarios/capacity_archs.py says what it measures; its
# options set the variables below), on one GPU with vLLM importable: each start until vLLM logs its memory report,
# the engine's predictions recorded before. Run from the repository root, with a free GPU, by the scenario:
#
#   python -m bench capacity-archs --profile h200 [--only qwen3-4b qwen3-30b-a3b] [--budget-s 780]
#   # everything is under --out (logs <arch>-<n>.log, predictions.json, summary.json, starts.tsv, DONE at the end)
#
# Settings of every start: --load-format dummy --max-num-seqs 64 --enforce-eager (eager: each start is ~50-75 s
# instead of ~100-125 s with torch.compile and CUDA-graph capture, which would not fit ten starts in ~12 minutes;
# calibration and prediction are both eager, so the comparison is like for like). vLLM is stopped as soon as it has
# logged "Free memory on device ... Actual usage is ...", the line after "GPU KV cache size".
# Environment: OUT (results), MODELS (model folders, default /tmp/capacity-models), BUDGET_S (an architecture whose
# two starts, ~PAIR_S = 150 s, would end after this many seconds from the script's start is skipped; default 780),
# START_TIMEOUT_S (one start, default 300), ONLY ("arch arch ...": a subset in this order, e.g. to finish what a
# budget cut), PY (the Python that runs vLLM and the helper; default python3). The profile (bench/profiles.toml)
# puts vLLM on PYTHONPATH (/tmp/site on the H200).
set -u
OUT=${OUT:-/var/tmp/capacity}
MODELS=${MODELS:-/tmp/capacity-models}
BUDGET_S=${BUDGET_S:-780}
PAIR_S=${PAIR_S:-150}
START_TIMEOUT_S=${START_TIMEOUT_S:-300}
ONLY=${ONLY:-}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -f "$OUT/DONE"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' '; }

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
BASE_MIB=$(gpu_used); BASE_MIB=${BASE_MIB:-0}
say "GPU memory used before anything: ${BASE_MIB} MiB"

# Before any start, at once (CPU work; the GPU is idle): the model folders and the engine's predictions (the
# device as torch sees it), the versions, and vLLM's inspection of each architecture, which it does in a
# subprocess at an architecture's first start (~24 s) and caches
pids=()
timeout 300 "$PY" -m bench.scenarios.capacity_archs prepare --out "$OUT" --models "$MODELS" > "$OUT/prepare.log" 2>&1 &
prepare=$!
"$PY" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__)" > "$OUT/versions.txt" 2>&1 &
pids+=($!)
for arch in Gemma3ForCausalLM MistralForCausalLM DeepseekV2ForCausalLM Qwen3MoeForCausalLM Qwen3ForCausalLM; do
  timeout 90 "$PY" -c "from vllm.model_executor.models.registry import ModelRegistry as R; \
print('$arch', R._try_inspect_model_cls('$arch') is not None)" >> "$OUT/prewarm.log" 2>&1 &
  pids+=($!)
done
wait "$prepare" || say "prepare failed (rc $?): see prepare.log; the starts go on where the model folders exist"
for p in "${pids[@]}"; do wait "$p" || true; done
say "versions: $(tr '\n' ' ' < "$OUT/versions.txt")"
say "model inspection cached: $(grep -c True "$OUT/prewarm.log" 2>/dev/null || echo 0) of 5"

wait_gpu_free() {  # until the memory is back to where it started (and no process holds the GPU), at most 90 s
  local deadline=$(( $(date +%s) + 90 )) used apps
  while [ "$(date +%s)" -lt "$deadline" ]; do
    used=$(gpu_used); apps=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)
    [ -n "$used" ] || return 0  # no nvidia-smi: nothing to wait for
    if [ -n "$used" ] && [ "$used" -le $(( BASE_MIB + 1024 )) ] && [ "$apps" -eq 0 ]; then return 0; fi
    sleep 1
  done
  say "GPU memory not back after 90 s: ${used:-?} MiB used, $apps process(es)"
  return 1
}

stop_group() {  # the whole process group of the start (API server, engine core), TERM then KILL
  local pid=$1 pgid deadline
  pgid=$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')
  if [ -n "$pgid" ] && [ "$pgid" != "$(ps -o pgid= -p $$ | tr -d ' ')" ]; then
    kill -TERM -- "-$pgid" 2>/dev/null
    deadline=$(( $(date +%s) + 30 ))
    while kill -0 -- "-$pgid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.5; done
    kill -KILL -- "-$pgid" 2>/dev/null
  else
    kill -TERM "$pid" 2>/dev/null; sleep 5; kill -KILL "$pid" 2>/dev/null
  fi
  wait "$pid" 2>/dev/null
}

run_start() {  # arch n util len -> OUT/arch-n.log; 0 when vLLM logged its memory report
  local arch=$1 n=$2 util=$3 len=$4 log="$OUT/$1-$2.log" port pid t1 state=timeout kv_seen=""
  port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  say "start $arch-$n: utilization $util, max_model_len $len, port $port (GPU used $(gpu_used) MiB)"
  t1=$(date +%s)
  setsid "$PY" -m vllm.entrypoints.openai.api_server --model "$MODELS/$arch" --served-model-name m \
    --load-format dummy --gpu-memory-utilization "$util" --max-model-len "$len" --max-num-seqs 64 \
    --enforce-eager --host 127.0.0.1 --port "$port" > "$log" 2>&1 < /dev/null &
  pid=$!
  while [ $(( $(date +%s) - t1 )) -lt "$START_TIMEOUT_S" ]; do
    if grep -q "Free memory on device" "$log"; then state=reported; sleep 1; break; fi
    if ! kill -0 "$pid" 2>/dev/null; then state=exited; break; fi
    if [ -z "$kv_seen" ] && grep -q "GPU KV cache size" "$log"; then kv_seen=$(date +%s); fi
    if [ -n "$kv_seen" ] && [ $(( $(date +%s) - kv_seen )) -gt 20 ]; then state=kv-only; break; fi
    sleep 1
  done
  local took=$(( $(date +%s) - t1 ))
  stop_group "$pid"
  say "  $arch-$n: $state after ${took}s; $(grep -o 'GPU KV cache size: [0-9,]* tokens' "$log" | head -1)"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$arch" "$n" "$util" "$len" "$state" "$took" >> "$OUT/starts.tsv"
  wait_gpu_free
  [ "$state" = reported ] || [ "$state" = kv-only ]
}

wait_gpu_free || true
printf 'arch\tn\tutil\tlen\tstate\tseconds\n' > "$OUT/starts.tsv"
"$PY" -m bench.scenarios.capacity_archs list > "$OUT/cases.txt"
for arch in ${ONLY:-$(cut -d' ' -f1 "$OUT/cases.txt" | uniq)}; do  # ONLY's order where given
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $arch "* ]]; then continue; fi
  if [ $(( $(date +%s) - T0 + PAIR_S )) -gt "$BUDGET_S" ]; then
    say "skip $arch: its two starts (~${PAIR_S}s) would end past the budget of ${BUDGET_S}s"; continue
  fi
  if [ ! -f "$MODELS/$arch/config.json" ]; then say "skip $arch: no model folder"; continue; fi
  while read -r a n util len; do
    [ "$a" = "$arch" ] || continue
    if [ "$n" = 2 ]; then
      timeout 120 "$PY" -m bench.scenarios.capacity_archs held-out --out "$OUT" --models "$MODELS" --arch "$arch" < /dev/null \
        >> "$OUT/run.log" 2>&1 || say "  no calibrated prediction for $arch-2 (see run.log)"
    fi
    run_start "$a" "$n" "$util" "$len" || { say "  $arch-$n failed: next architecture"; break; }
  done < "$OUT/cases.txt"
done

timeout 120 "$PY" -m bench.scenarios.capacity_archs summary --out "$OUT" --models "$MODELS" >> "$OUT/run.log" 2>&1
say "done in $(( $(date +%s) - T0 ))s"
date > "$OUT/DONE"
