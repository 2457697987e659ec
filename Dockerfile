# syntax=docker/dockerfile:1
# One image for every role: `cleave router | prefill-worker | decode-worker | planner | demo-model`.
#   CPU (default):  docker build -t cleave:0.1.0 .
#   CUDA:           docker build -t cleave:0.1.0-cuda --build-arg FLAVOR=cuda .
# Models come from a volume mounted at /models; nothing is downloaded at start.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the project as a wheel, torch for the flavour, the native CPU kernel -------------
FROM ${PYTHON_IMAGE} AS build
ARG FLAVOR=cpu
ARG TORCH_VERSION=2.13.0
# The CPU flavour takes torch from its CPU-only wheel index (no CUDA libraries in the image).
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
# Not -march=native: the image runs on hosts unknown here. x86-64-v2 runs on any x86 server of the
# last decade; x86-64-v3 (AVX2 and FMA: the kernels' own float32 projection instead of torch's BLAS) is
# faster where every node has it; arm64 hosts take e.g. armv8.2-a.
ARG CPU_KERNEL_MARCH=x86-64-v2
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN python -m venv /opt/cleave \
 && if [ "$FLAVOR" = cuda ]; then \
      /opt/cleave/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    else \
      /opt/cleave/bin/pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi \
 && /opt/cleave/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && extras=$([ "$FLAVOR" = cuda ] && echo "[nixl]" || true) \
 && /opt/cleave/bin/pip install --no-cache-dir "$(ls /wheels/cleave-*.whl)${extras}"
RUN mkdir -p /opt/cleave/lib \
 && /opt/cleave/bin/python -m shared.kernels.cpu_kernels /opt/cleave/lib/cpu_kernels.so --march ${CPU_KERNEL_MARCH}

# ---- runtime: no compiler, non-root, read-only root filesystem friendly ----------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 cleave \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cleave \
 && mkdir /models && chown 10001:10001 /models
COPY --from=build /opt/cleave /opt/cleave
ENV PATH=/opt/cleave/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    CLEAVE_CPU_KERNEL_LIB=/opt/cleave/lib/cpu_kernels.so
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 50051 9090
ENTRYPOINT ["cleave"]
CMD ["--help"]
