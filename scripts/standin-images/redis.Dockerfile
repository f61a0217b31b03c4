# Stand-in for redis:7-alpine where no registry is reachable (scripts/compose-smoke.sh builds it only then).
# It really is Debian bookworm's redis-server 7.0.x on Debian, not Alpine. Like the official image it runs as the
# redis user and, started without a config file, accepts clients from other containers (protected mode off).
FROM swarmbatch-standin/bookworm:minbase
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
EXPOSE 6379
LABEL org.swarmbatch.standin="redis:7-alpine stand-in: Debian bookworm redis-server 7.0"
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
