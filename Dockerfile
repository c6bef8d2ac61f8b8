# syntax=docker/dockerfile:1
# One image for every inferfleet role: worker, supervisor, producer tools, bench.
#
#   docker build -t inferfleet:0.1.0 .                                  # CPU torch (default)
#   docker build -t inferfleet:0.1.0-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .   # CUDA torch
#
# The example models are built into /app/models at build time (no download).
FROM python:3.11-slim

# Where torch comes from: the CPU wheel index by default, so a plain build never pulls a
# multi-GB CUDA build; a CUDA index (cu126, cu128, ...) for GPU images.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Pin torch here if you need to ("torch==2.6.0"); the project needs torch>=2.2.
ARG TORCH_SPEC="torch>=2.2"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first and on its own layer: it is the big one and changes least often.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

COPY pyproject.toml README.md ./
COPY inferfleet ./inferfleet
COPY producer ./producer
COPY worker ./worker
RUN pip install ".[worker]" && rm -rf build

COPY scripts/build_models.py ./scripts/build_models.py
RUN python scripts/build_models.py --out /app/models

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
