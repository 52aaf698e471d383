# The service image: rollout, reward (PickScore, OCR, JPEG, plug-ins) and trainer replicas. One
# image for the three: they share torch, the model code and the bus, and a host pulls one large
# layer instead of three.
#   GPU (PyTorch with CUDA from the base image; pip keeps it: the torch extra's range admits it):
#     docker build -f deploy/docker/service.Dockerfile -t flowgrpo-gpu .
#   CPU (the whole stack without GPUs; torch from the CPU wheel index):
#     docker build -f deploy/docker/service.Dockerfile -t flowgrpo-cpu --build-arg BASE=python:3.11-slim \
#       --build-arg TORCH=torch==2.13.0 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   --build-arg PIP_ARGS="--no-index --find-links /wheels"   installs from a wheelhouse (offline;
#                                                 deploy/ci/containers.sh does this under podman)
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

# Stage 1: the project as a wheel (a non-editable install: the image holds no source tree).
FROM ${BASE} AS wheel
ARG PIP_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src src
COPY services services
RUN python3 -m venv /opt/build && /opt/build/bin/pip wheel $PIP_ARGS --no-deps --wheel-dir /dist .

# Stage 2: a virtual environment that sees the base's torch (--system-site-packages), the wheel
# and the three services' extras.
FROM ${BASE}
ARG PIP_ARGS=""
ARG TORCH=""
ARG TORCH_INDEX_URL=""
ARG EXTRAS=rollout,trainer,reward
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/flowgrpo PATH=/opt/flowgrpo/bin:$PATH
RUN command -v tini >/dev/null || (apt-get update && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*)
RUN python3 -m venv --system-site-packages $VIRTUAL_ENV \
    && if [ -n "$TORCH" ]; then pip install $PIP_ARGS ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} "$TORCH"; fi
COPY --from=wheel /dist /dist
RUN pip install $PIP_ARGS "$(ls /dist/flowgrpo-*.whl)[$EXTRAS]" && rm -rf /dist \
    && cd / && python -c "import torch, flowgrpo.services.trainer.service, flowgrpo.services.rollout.engine"
WORKDIR /app
EXPOSE 50051
# tini as PID 1 forwards SIGTERM / SIGINT (the services drain on either) and reaps children
ENTRYPOINT ["tini", "--"]
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 \
    CMD ["flowgrpo", "probe", "localhost:50051"]
CMD ["flowgrpo", "--help"]
