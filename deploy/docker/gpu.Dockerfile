# The GPU image: rollout, reward (PickScore on the GPU, OCR, JPEG, plug-ins) and trainer replicas.
# PyTorch with CUDA comes from the base image; pip keeps it (the torch extra's range admits it).
#   docker build -f deploy/docker/gpu.Dockerfile -t flowgrpo-gpu .
# One image for the three GPU services: they share torch, the model code and the bus, and a
# host pulls one large layer instead of three.
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY flowgrpo flowgrpo
COPY services services
COPY examples examples
RUN python -m pip install '.[rollout,trainer,reward]' \
    && python -c "import torch, flowgrpo.services.trainer.service, flowgrpo.services.rollout.engine"

EXPOSE 50051
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 \
    CMD ["flowgrpo", "probe", "localhost:50051"]
ENTRYPOINT []
CMD ["flowgrpo", "--help"]
