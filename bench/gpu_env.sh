# Sourced by the bench/*_gpu.sh scripts: make this checkout importable on the lent GPU machines
# (Python 3.12, torch, no pyzmq / OpenTelemetry / protobuf 7) without installing it.
#  - the wheels of bench/fetch_gpu_wheels.sh (carried as .whl) go to /tmp/site when the bus's
#    imports are missing;
#  - the library is src/flowgrpo, the services reach it through the link src/flowgrpo/services
#    -> ../../services; where the copy of the checkout lost that link, the two are laid out
#    together in /tmp/fgsrc.
# Sets PY (the interpreter) and PYTHONPATH; subprocesses (the services, torchrun) inherit both.
# Sourced again under a shell that already did (FLOWGRPO_GPU_ENV names this checkout) it changes
# nothing: two scripts in one call, one in the background (`compose_scale_gpu.sh start`, then
# `gpu_check.sh`), must not lay out /tmp/site and /tmp/fgsrc again under the other's imports.
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [[ ${FLOWGRPO_GPU_ENV:-} == "$PWD" ]]; then
    return 0
fi
_site=""
if compgen -G ".whl/*.whl" >/dev/null && ! $PY -c "import zmq, opentelemetry" 2>/dev/null; then
    _wheels=(.whl/*.whl)
    # scipy (the compose verifier) only where the machine has none: never shadow its own build
    if $PY -c "import scipy" 2>/dev/null; then
        _wheels=("${_wheels[@]/*scipy-*}")
    fi
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        ${_wheels[@]} && _site=/tmp/site
fi
_src=$PWD/src
if ! PYTHONPATH="$_src" $PY -c "import flowgrpo.services.bench" 2>/dev/null; then
    rm -rf /tmp/fgsrc && mkdir -p /tmp/fgsrc && cp -r src/flowgrpo /tmp/fgsrc/
    rm -rf /tmp/fgsrc/flowgrpo/services && cp -r services /tmp/fgsrc/flowgrpo/
    _src=/tmp/fgsrc
fi
export PYTHONPATH="${_site:+$_site:}$_src${PYTHONPATH:+:$PYTHONPATH}"
export FLOWGRPO_GPU_ENV=$PWD
