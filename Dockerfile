# One image for every swarmbatch process (dht, serve, worker, beat, api, db upgrade); see docker-compose.yml.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    SWARMBATCH_HOME=/data

# torch first, alone, as the CPU build: the project's torch range then keeps pip from pulling a CUDA build.
# A GPU block server runs outside this image, on a host with a CUDA torch (see docs/deploying.md). TORCH_SOURCE is where pip
# finds it: the PyTorch CPU index; a machine without it may point pip at a mirror or a wheel folder served over
# HTTP (scripts/compose-smoke.sh: --build-arg TORCH_SOURCE="--find-links http://127.0.0.1:PORT/" --network host).
ARG TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cpu"
RUN pip install torch==2.13.0 $TORCH_SOURCE

WORKDIR /app
# the dependencies next, from pyproject.toml alone: a change to the sources then rebuilds only the last pip layer
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    > /tmp/requirements.txt && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md cli.py ./
COPY commands ./commands
COPY swarmnet ./swarmnet
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
# (dht-address), /keys (a member process's own key volume), /swarm (swarm-file) and /members/NAME (each key volume,
# where swarm-init writes the keys). /schedules is a bind mount: the host folder must be writable by uid 10001.
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home --shell /usr/sbin/nologin swarmbatch
RUN mkdir -p /data/models /dht /keys /swarm /members/dht /members/server1 /members/server2 /members/worker /schedules \
    && chown swarmbatch:swarmbatch /data /data/models /dht /keys /swarm /members/dht /members/server1 /members/server2 /members/worker /schedules
USER swarmbatch:swarmbatch

ENTRYPOINT ["swarmbatch"]
CMD ["--help"]
