# steadyserve image: `docker build --build-arg TORCH_VARIANT=cpu --build-arg TORCH_INDEX_URL=<url> .`
# TORCH_VARIANT names the torch build (`cpu`, or a CUDA one such as `cu126`) and TORCH_INDEX_URL
# is PyTorch's wheel index for that variant (each variant is published on its own index; the
# default index carries only one of them). The CUDA wheels bring their CUDA libraries with them,
# so both variants share this slim base; the node's NVIDIA container runtime adds the driver.
# CI lints this file with hadolint; no Docker engine runs there (deploy/README.md).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -m venv /opt/venv
# torch first, from the variant's own index, so that installing steadyserve below finds its
# `torch` requirement met and never pulls the other variant.
RUN if [ -z "${TORCH_INDEX_URL}" ]; then \
        echo "set --build-arg TORCH_INDEX_URL to PyTorch's ${TORCH_VARIANT} wheel index" >&2; \
        exit 1; \
    fi \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md constraints-lock.txt ./
COPY app ./app
COPY loadtest ./loadtest
# Constrained to the torch installed above, so a dependency that asks for another torch fails
# the build instead of swapping in a build from PyPI (a CUDA one), and to the versions of every
# other package that the tests passed with (constraints-lock.txt). Then the torch in the venv
# must still be that one.
RUN echo "torch==${TORCH_VERSION}+${TORCH_VARIANT}" > /tmp/torch-constraints.txt \
    && pip install --no-cache-dir -c /tmp/torch-constraints.txt -c constraints-lock.txt . \
    && python -c "import sys, torch; want = sys.argv[1]; print('torch', torch.__version__); sys.exit(torch.__version__ != want and f'torch {torch.__version__} is installed, not {want}')" "${TORCH_VERSION}+${TORCH_VARIANT}" \
    && python -c "import app.cli"

FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="steadyserve" \
      org.opencontainers.image.description="HTTP inference server that keeps tail latency flat" \
      io.steadyserve.torch-variant="${TORCH_VARIANT}"
RUN groupadd --system --gid 10001 steadyserve \
    && useradd --system --uid 10001 --gid steadyserve --no-create-home \
        --home-dir /tmp --shell /usr/sbin/nologin steadyserve
COPY --from=build /opt/venv /opt/venv
# HF_HUB_OFFLINE: the model ships in the image; a pod never downloads weights at start-up.
# DL3064 reads TOKENIZERS_PARALLELISM as a secret ("TOKEN"); it is the tokenizers thread switch.
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    HOME=/tmp \
    STEADY_HEALTH_PORT=8001
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 8001
# Liveness only (/healthz): readiness (/readyz) is the orchestrator's decision, and a warming
# replica must not be restarted. On the supervisor's probe port, as Kubernetes probes it: it
# carries no traffic, so a flood on 8000 cannot time the check out (and `serve --port` may
# move the traffic port). The slim image has no curl; Python is there anyway.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:' + os.environ['STEADY_HEALTH_PORT'] + '/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["steadyserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
