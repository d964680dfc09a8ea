# Sourced by each bench/gpu_session_*.sh on the H200 machine, from the project's root after staging
# (../shared/gpu/README.md): the environment vLLM and the engine run with there, $O for the results, mark() for
# $O/progress.txt, the 8B-shaped model in /tmp/m8b, what nvidia-smi says of the GPU and the versions of vLLM,
# torch and transformers.
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
O=${O:-/var/tmp/out}; mkdir -p $O
T0=$(date +%s); mark() { echo "$(( $(date +%s) - T0 )) s: $*" >> $O/progress.txt; }
python3 .gpu/make_shape_model.py /tmp/m8b > $O/model.log 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > $O/gpu.txt
python3 -c "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)" \
  > $O/versions.txt 2>&1
