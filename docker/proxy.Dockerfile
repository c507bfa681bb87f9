# syntax=docker/dockerfile:1
# The atdp proxy (`atdp serve`): the base package and LiteLLM (provider routes), no torch.
#   docker build -f docker/proxy.Dockerfile -t atdp-proxy .     (context: the repository root)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/atdp
WORKDIR /src
COPY constraints.txt pyproject.toml ./
COPY proxy proxy
COPY trainer trainer
COPY atdp_schema atdp_schema
COPY migrations migrations
# Not editable: the runtime stage gets only the venv. constraints.txt pins every version.
RUN /opt/atdp/bin/pip install -c constraints.txt '.[providers]'

FROM ${PYTHON_IMAGE}
# One uid for the proxy and trainer images: both write the shared ATDP_HOME volume.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/atdp --no-create-home atdp \
 && install -d -o atdp -g atdp /var/lib/atdp
COPY --from=build /opt/atdp /opt/atdp
ENV PATH=/opt/atdp/bin:$PATH PYTHONUNBUFFERED=1 ATDP_HOME=/var/lib/atdp
USER atdp
WORKDIR /var/lib/atdp
EXPOSE 8700
# Off loopback the proxy requires API keys (ATDP_OPEN_MODE is refused there).
CMD ["atdp", "serve", "--host", "0.0.0.0", "--port", "8700"]
