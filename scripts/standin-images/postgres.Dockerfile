# Stand-in for postgres:16-alpine where no registry is reachable (scripts/compose-smoke.sh builds it only then).
# It really is Debian bookworm's PostgreSQL 15, not 16 (bookworm has no 16). Its entrypoint does what the official
# one does for the compose file: on an empty PGDATA, initdb with POSTGRES_USER / POSTGRES_PASSWORD (scram-sha-256
# from other hosts), create POSTGRES_DB; then run postgres as the postgres user, listening on every interface.
FROM swarmbatch-standin/bookworm:minbase
RUN mkdir -p /etc/postgresql-common && echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.conf \
    && apt-get update && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && mkdir -p /var/lib/postgresql/data /run/postgresql \
    && chown postgres:postgres /var/lib/postgresql/data /run/postgresql && chmod 700 /var/lib/postgresql/data
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
EXPOSE 5432
LABEL org.swarmbatch.standin="postgres:16-alpine stand-in: Debian bookworm PostgreSQL 15"
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
