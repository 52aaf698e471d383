#!/usr/bin/env bash
# Fetch the few cp312 wheels a GPU run needs into .whl/ (ignored by git), for the lent H200
# machines: they have Python 3.12 and torch but no pyzmq, no OpenTelemetry and older protobuf.
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
pip_download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$@"
}
pip_download \
    pyzmq==27.3.0 msgpack==1.2.4 protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
    opentelemetry-instrumentation==0.66b2 opentelemetry-instrumentation-grpc==0.66b2 \
    opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
    opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0 importlib-metadata zipp \
    scipy==1.16.3 `# the compose verifier (connected components)` \
    torchao==0.18.0  # bench fp8 --torchao
ls .whl
