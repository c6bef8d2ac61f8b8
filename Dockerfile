# syntax=docker/dockerfile:1
# One image for every inferfleet role: worker, supervisor, producer tools, bench.
#
#   docker build -t inferfleet:0.1.0 .                                  # CPU torch (default)
#   docker build -t inferfleet:0.1.0-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .   # CUDA torch
#
# The example models are built into /app/models at build time (no download). To serve your
# own model, mount it or derive an image from this one (docs/deploy.md, "Your own model").

# The base image: any Debian-like image with python3.11 and pip on PATH (the compose test
# passes a stand-in built from Debian's packages where the public registry is out of reach).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# Where torch comes from: the CPU wheel index by default, so a plain build never pulls a
# multi-GB CUDA build; a CUDA index (cu126, cu128, ...) for GPU images.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The versions the project's tests ran with (redis: constraints.txt, which scripts/_venv.sh
# installs with); the project itself needs torch>=2.2, redis>=5.
ARG TORCH_SPEC="torch==2.13.0"
ARG REDIS_SPEC="redis[hiredis]==8.2.0"
# Which ONNX Runtime: onnx (the CPU build) or gpu (onnxruntime-gpu, its CUDA provider: the CUDA
# image's, docker-compose.gpu.yml).
ARG ONNX_EXTRA=onnx

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and on its own layer: it is the big one and changes least often.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# The sources go to /src and are removed once installed: a copy of inferfleet/ next to the
# scripts would shadow the installed package (whose producer/ and worker/ it lacks).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY inferfleet ./inferfleet
COPY producer ./producer
COPY worker ./worker
# worker: the fleet, the CLI, the bench; onnx or gpu: ONNX Runtime, to serve .onnx models.
RUN pip install "${REDIS_SPEC}" ".[worker,${ONNX_EXTRA}]" && rm -rf /src/*

WORKDIR /app

# The example models: tests/fixtures is a package, run with python -m from /app.
COPY tests/__init__.py ./tests/__init__.py
COPY tests/fixtures/__init__.py ./tests/fixtures/__init__.py
COPY tests/fixtures/build_models.py ./tests/fixtures/build_models.py
RUN python -m tests.fixtures.build_models --out /app/models

# Not root: the worker needs no privileges (its home holds torch's caches).
RUN useradd --create-home --uid 10001 --user-group inferfleet
USER inferfleet

# SIGTERM drains: a worker finishes its batch, answers its read-ahead and leaves the group;
# the supervisor drains every worker for up to --drain-timeout-s. A second SIGTERM exits at
# once. Give the container a stop grace longer than the drain timeout (compose:
# stop_grace_period; Kubernetes: terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
# Prometheus /metrics (--metrics-port / INFERFLEET_METRICS_PORT)
EXPOSE 9100

ENTRYPOINT ["inferfleet"]
CMD ["--help"]
