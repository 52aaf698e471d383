# The coordinator's image: no torch, no CUDA (it moves references and scalars, never tensors).
#   docker build -f deploy/docker/coordinator.Dockerfile -t flowgrpo-coordinator .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY flowgrpo flowgrpo
COPY services services
COPY examples examples
RUN python -m pip install '.[coordinator,wandb]' \
    && python -c "import sys, flowgrpo.services.coordinator.train; assert 'torch' not in sys.modules"

EXPOSE 50050
HEALTHCHECK --interval=10s --timeout=10s --start-period=60s --retries=3 \
    CMD ["flowgrpo", "probe", "localhost:50050"]
CMD ["flowgrpo", "--help"]
