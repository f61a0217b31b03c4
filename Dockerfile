# One image for every swarmbatch process (dht, serve, worker, beat, api, db upgrade); see docker-compose.yml.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    SWARMBATCH_HOME=/data

# torch first, alone, as the CPU build: the project's torch range then keeps pip from pulling a CUDA build.
# A GPU block server runs outside this image, on a host with a CUDA torch (see README).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md cli.py ./
COPY commands ./commands
COPY swarmclient ./swarmclient
COPY servers ./servers
COPY jobs ./jobs
COPY modelprep ./modelprep
COPY migrations ./migrations
COPY launch ./launch
COPY samples ./samples
RUN pip install .

# Every process runs as this unprivileged user. The mount points of the named volumes exist here and belong to it,
# so Docker creates each new volume owned by it: /data (swarmbatch-home), /data/models (models), /dht
# (dht-address) and /keys (the DHT node's or a server's own key volume). /schedules is a bind mount: the host folder
# must be writable by uid 10001.
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home --shell /usr/sbin/nologin swarmbatch
RUN mkdir -p /data/models /dht /keys /schedules && chown swarmbatch:swarmbatch /data /data/models /dht /keys /schedules
USER swarmbatch:swarmbatch

ENTRYPOINT ["swarmbatch"]
CMD ["--help"]
