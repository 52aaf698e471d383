# The coordinator's image: no torch, no CUDA (it moves references and scalars, never tensors).
#   docker build -f deploy/docker/coordinator.Dockerfile -t flowgrpo-coordinator .
#   --build-arg EXTRAS=coordinator,report,wandb   adds `flowgrpo report` plots and W&B logging
#   --build-arg PIP_ARGS="--no-index --find-links /wheels"   installs from a wheelhouse (offline;
#                                                 deploy/ci/containers.sh does this under podman)
ARG BASE=python:3.11-slim

# Stage 1: the project as a wheel (a non-editable install: the image holds no source tree).
FROM ${BASE} AS wheel
ARG PIP_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src src
COPY services services
RUN python3 -m venv /opt/build && /opt/build/bin/pip wheel $PIP_ARGS --no-deps --wheel-dir /dist .

# Stage 2: a virtual environment with the wheel and only what the coordinator needs at run time.
FROM ${BASE}
ARG PIP_ARGS=""
ARG EXTRAS=coordinator
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/flowgrpo PATH=/opt/flowgrpo/bin:$PATH
RUN command -v tini >/dev/null || (apt-get update && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*)
COPY --from=wheel /dist /dist
RUN python3 -m venv $VIRTUAL_ENV \
    && pip install $PIP_ARGS "$(ls /dist/flowgrpo-*.whl)[$EXTRAS]" && rm -rf /dist \
    && cd / && python -c "import sys, flowgrpo.services.coordinator.train; assert 'torch' not in sys.modules"
WORKDIR /app
EXPOSE 50050
# tini as PID 1 forwards SIGTERM / SIGINT to the coordinator and reaps what it started
ENTRYPOINT ["tini", "--"]
HEALTHCHECK --interval=10s --timeout=10s --start-period=60s --retries=3 \
    CMD ["flowgrpo", "probe", "localhost:50050"]
CMD ["flowgrpo", "--help"]
