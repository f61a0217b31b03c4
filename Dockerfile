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
RUN pip install . && mkdir -p /data/models /dht

ENTRYPOINT ["swarmbatch"]
CMD ["--help"]
