#!/bin/sh
# redis:7-alpine stand-in: run redis-server as the redis user, reachable from the other containers.
set -e
if [ "$1" = redis-server ]; then
  shift
  exec setpriv --reuid=redis --regid=redis --init-groups redis-server --protected-mode no "$@"
fi
exec "$@"
