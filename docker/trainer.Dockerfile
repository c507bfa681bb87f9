# syntax=docker/dockerfile:1
# The atdp trainer sidecar (`atdp train` under torchrun): the package with its [train] extra.
#   docker build -f docker/trainer.Dockerfile -t atdp-trainer .                        (CUDA torch)
#   docker build -f docker/trainer.Dockerfile --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t atdp-trainer-cpu .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# An extra index for torch. Empty: PyPI's linux/x86_64 wheel, the CUDA build (it brings its own CUDA
# libraries; the host needs only the NVIDIA driver and container toolkit). A PyTorch index such as
# .../whl/cpu offers X+cpu next to PyPI's X, and pip takes the local build as the higher version;
# PyPI stays the main index so every other pin in constraints.txt resolves as usual.
ARG TORCH_INDEX_URL=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/atdp
WORKDIR /src
COPY constraints.txt pyproject.toml ./
# constraints.txt pins the +cpu torch build the repository's own environment uses; keep its version
# and let TORCH_INDEX_URL choose the build. torch goes first, alone, from that index.
RUN sed -E 's/^(torch==[^+]+)\+.*$/\1/' constraints.txt > /tmp/constraints.txt \
 && /opt/atdp/bin/pip install -c /tmp/constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch
COPY proxy proxy
COPY trainer trainer
COPY atdp_schema atdp_schema
COPY migrations migrations
RUN /opt/atdp/bin/pip install -c /tmp/constraints.txt '.[train]'

FROM ${PYTHON_IMAGE}
# Same uid as the proxy image: both write the shared ATDP_HOME volume (checkpoints, secret).
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/atdp --no-create-home atdp \
 && install -d -o atdp -g atdp /var/lib/atdp
COPY --from=build /opt/atdp /opt/atdp
ENV PATH=/opt/atdp/bin:$PATH PYTHONUNBUFFERED=1 ATDP_HOME=/var/lib/atdp
USER atdp
WORKDIR /var/lib/atdp
CMD ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "proxy.cli", "train"]
