# Stand-in for python:3.11-slim where no registry is reachable (scripts/compose-smoke.sh builds it only then).
# It really is Debian bookworm's python3 3.11.2 with its pip 23.0.1, not the official image (Python 3.11.x, pip
# 24+): `python`, `pip` and pip installs into /usr/local as the project's Dockerfile expects. It trusts this host's
# extra CA certificates (ca/), so pip in it reaches the package index as the host's pip does.
FROM swarmbatch-standin/bookworm:minbase
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python-is-python3 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates && printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf
LABEL org.swarmbatch.standin="python:3.11-slim stand-in: Debian bookworm python3 3.11.2, pip 23.0.1"
CMD ["python3"]
