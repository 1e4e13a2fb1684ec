# The orchestrator image that deploy/ runs (orchard-env:latest; docs/env-kubernetes.md):
#   orchard env serve --backend kubernetes        the Deployment's container
#   python -m orchard.env.backends.kubernetes.inject DIR   each sandbox pod's init container: copies the exec agent
#                                                  (standard library only) into the pod's shared volume
#
#   docker build -t REGISTRY/orchard-env:TAG .
#
# The orchestrator never imports torch, but `orchard` itself requires it: the CPU wheel of the version we test
# keeps the image small (no CUDA libraries).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
WORKDIR /src
COPY pyproject.toml setup.cfg README.md LICENSE ./
COPY orchard ./orchard
RUN python -m venv /opt/orchard \
 && /opt/orchard/bin/pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "torch==${TORCH_VERSION}" \
 && /opt/orchard/bin/pip install --no-cache-dir ".[env,redis,k8s]"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="orchard-env" \
      org.opencontainers.image.description="orchard's sandbox service (orchestrator and exec agent)"
COPY --from=build /opt/orchard /opt/orchard
# `orchard` and `python` (the init container's command) are the virtual environment's; the root file system is
# read-only in deploy/, so no bytecode is written at run time
ENV PATH=/opt/orchard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# the uid deploy/ runs it as (runAsUser 65532, runAsNonRoot)
USER 65532:65532
WORKDIR /tmp
EXPOSE 8000
CMD ["orchard", "env", "serve", "--backend", "kubernetes", "--host", "0.0.0.0", "--port", "8000"]
