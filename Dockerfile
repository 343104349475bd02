# det-local's daemon in a container, on the host's NVIDIA GPUs.
#
#   docker build -t det-local .
#   docker run -d --name det-local --gpus all --restart unless-stopped \
#       -v det-local:/var/lib/det-local -v "$PWD":/work det-local
#   docker exec -w /work det-local det-local cmd run --slots 1 -- nvidia-smi -L
#   docker exec -w /work det-local det-local run --detach config.yaml .
#   docker exec det-local det-local job list
#
# `--gpus all` needs the NVIDIA Container Toolkit on the host; it brings the driver's libraries
# (NVML included) into the container. Without it (or on a machine with no GPU) the daemon uses
# CPU slots: add `-e DET_LOCAL_CPU_SLOTS=N`. Settings go in daemon.yaml in the volume
# (docs/system-mode.md lists them). The trials run in this image, so their Python packages must
# be installed here: extend it (FROM det-local, RUN pip install ...).
#
# torch: the default PyPI wheel for Linux x86_64 bundles the CUDA runtime, so the base image needs
# none; pick a version with `--build-arg TORCH="torch==X.Y.Z"`, or a CPU-only build for a machine
# with no GPU (README, Quickstart).
#
# Stopping the container ends its jobs (they live in its PID namespace); at the next start the
# daemon settles them: trials are queued again to resume from their latest checkpoint, commands
# are marked with their exit status (or "unknown"), and queued jobs stay queued.
#
# Sharing the queue with the host's users (system mode, docs/system-mode.md) rather than with
# `docker exec`: bind-mount the home instead of a volume, plus what identifies the users and
# holds their code, at the same paths, and put the same det-local version on the host:
#   -v /var/lib/det-local:/var/lib/det-local -v /home:/home \
#   -v /etc/passwd:/etc/passwd:ro -v /etc/group:/etc/group:ro --pid=host
# (--pid=host makes the GPU processes NVML reports match the daemon's own jobs in `slots`.)

FROM python:3.11-slim-bookworm

ARG TORCH=torch

# tini as PID 1: it forwards SIGTERM to the daemon and reaps the jobs' orphaned descendants
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DET_LOCAL_HOME=/var/lib/det-local

# torch first, in its own layer: it is by far the largest and changes least often
# unquoted: TORCH may carry pip options (an index for a particular CUDA or CPU build)
RUN pip install ${TORCH}

COPY pyproject.toml setup.py README.md /src/
COPY det_local /src/det_local
RUN pip install /src && rm -rf /src

VOLUME /var/lib/det-local
WORKDIR /work

HEALTHCHECK --interval=30s --timeout=10s --start-period=30s \
    CMD det-local daemon status > /dev/null || exit 1

# SIGTERM (docker stop) stops the daemon cleanly; give it time to answer pending requests
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "-s", "--"]
CMD ["det-local", "daemon"]
