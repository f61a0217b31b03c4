#!/usr/bin/env bash
# The compose deployment for real: build the project's image with its own Dockerfile, `up` its docker-compose.yml,
# and do what docs/deploying.md "One machine: docker compose" tells a user to do, then `down -v`. Prints each step's time and
# the image sizes.
#
# Needs root (it installs and starts the Docker engine where missing). Exit 77 = cannot run here (the reason is one
# line on stderr): not root, no engine and no apt-get, or SWARMBATCH_SKIP_COMPOSE=1.
#
# Where no image registry is reachable (this project's CI), it makes local stand-ins for the images the build and
# the compose file name, only for a tag that is missing and cannot be pulled: python:3.11-slim, redis:7-alpine and
# postgres:16-alpine, built from Debian bookworm packages (debootstrap; scripts/standin-images/ says which versions
# they really are). Where the PyTorch CPU index is unreachable it serves pip's local find-links folder (the host's
# `pip config`) on 127.0.0.1 to the build. Neither changes what a real user builds and runs.
#
# It stops what it started, also on failure: the stack (`down -v`, any container left), the wheel server, and
# dockerd if it started it (by PID), and then undoes dockerd's host changes: IP forwarding back to its previous
# value, the iptables rules and chains it added, the docker0 bridge. Images stay (the next run builds from cache).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PROJECT=swarmbatch-smoke
IMAGE=swarmbatch:latest
STANDIN_BASE=swarmbatch-standin/bookworm:minbase
TIMEOUT=${SWARMBATCH_COMPOSE_TIMEOUT:-900}   # seconds for the stack to become healthy, and for the batch

skip() { echo "compose smoke skipped: $*" >&2; exit 77; }
fail() { echo "compose smoke FAILED: $*" >&2; exit 1; }
[ "${SWARMBATCH_SKIP_COMPOSE:-}" = 1 ] && skip "SWARMBATCH_SKIP_COMPOSE=1"
[ "$(id -u)" = 0 ] || skip "needs root to install and start the Docker engine (run as root, or set SWARMBATCH_SKIP_COMPOSE=1)"
command -v dockerd >/dev/null || command -v apt-get >/dev/null \
  || skip "no Docker engine and no apt-get to install one (install docker.io and docker-compose)"

WORK=$(mktemp -d /tmp/compose-smoke.XXXXXX)
STEPS=()
BEGAN=$(date +%s.%N)
DOCKERD_PID="" WHEELS_PID="" STACK_UP="" IP_FORWARD_BEFORE="" DOCKER0_BEFORE=""

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
# step NAME COMMAND...: run it, print and keep its time
step() {
  local step_name=$1 step_began
  shift
  step_began=$(date +%s.%N)
  echo "== $step_name ($(date -u +%H:%M:%S))"
  "$@"
  STEPS+=("$(printf '%-52s %7s s' "$step_name" "$(elapsed "$step_began")")")
}

compose() { env -i PATH="$PATH" HOME="${HOME:-/root}" "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/docker-compose.yml" \
              --env-file "$WORK/.env" "$@"; }

# ---- the engine --------------------------------------------------------------------------------------------------
install_engine() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
  [ ${#missing[@]} = 0 ] && { echo "engine installed"; return; }
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
}

# the iptables rules of the tables dockerd touches, counters zeroed (so that they compare)
iptables_rules() { { iptables-save 2>/dev/null || true; } | sed -E 's/\[[0-9]+:[0-9]+\]/[0:0]/'; }

start_engine() {
  if docker info >/dev/null 2>&1; then echo "dockerd already running"; return; fi
  IP_FORWARD_BEFORE=$(cat /proc/sys/net/ipv4/ip_forward)
  ip link show docker0 >/dev/null 2>&1 && DOCKER0_BEFORE=1
  iptables_rules > "$WORK/iptables.before"
  setsid dockerd > "$WORK/dockerd.log" 2>&1 < /dev/null &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && { echo "started dockerd (pid $DOCKERD_PID)"; return; }
    kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$WORK/dockerd.log" >&2; fail "dockerd exited"; }
    sleep 1
  done
  fail "dockerd did not answer within 60 s (log: $WORK/dockerd.log)"
}

# Put back the iptables rules of before dockerd: every rule and chain present then, nothing it added (the FORWARD
# policy it set to DROP included); rules others added meanwhile are lost only if they were in the same tables.
restore_iptables() {
  iptables_rules > "$WORK/iptables.after"
  python3 - "$WORK/iptables.before" "$WORK/iptables.after" > "$WORK/iptables.restore" <<'EOF'
import sys
before = open(sys.argv[1]).read().splitlines()
after = open(sys.argv[2]).read().splitlines()
kept = set(before)
table, policies = None, {}
for line in before:
    if line.startswith("*"):
        table = line[1:]
    elif line.startswith(":"):
        policies[(table, line.split()[0])] = line
out, table = [], None
for line in after:
    if line.startswith("*"):
        table = line[1:]
        out.append(line)
    elif line == "COMMIT":
        out.append(line)
    elif line.startswith(":"):
        chain, target = line.split()[0], line.split()[1]
        if target != "-":  # a built-in chain: its policy of before (ACCEPT if the table was not there)
            out.append(policies.get((table, chain), f"{chain} ACCEPT [0:0]"))
        elif line in kept:
            out.append(line)
    elif line in kept:
        out.append(line)
print("\n".join(out))
EOF
  iptables-restore < "$WORK/iptables.restore"
  # a table that did not exist before (iptables-nft made it for dockerd) goes again, empty as it now is
  if iptables -V | grep -q nf_tables && command -v nft >/dev/null; then
    for table in $(sed -n 's/^\*//p' "$WORK/iptables.after"); do
      grep -qx "\*$table" "$WORK/iptables.before" || nft delete table ip "$table"
    done
  fi
}

stop_engine() {
  [ -n "$DOCKERD_PID" ] || return 0
  echo "stopping dockerd (pid $DOCKERD_PID)"
  kill "$DOCKERD_PID" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$DOCKERD_PID" 2>/dev/null && { echo "dockerd still running: SIGKILL"; kill -9 "$DOCKERD_PID"; }
  restore_iptables || echo "could not restore iptables: compare $WORK/iptables.before with iptables-save" >&2
  echo "$IP_FORWARD_BEFORE" > /proc/sys/net/ipv4/ip_forward
  [ -n "$DOCKER0_BEFORE" ] || ip link delete docker0 2>/dev/null || true
  echo "dockerd stopped; ip_forward back to $IP_FORWARD_BEFORE; iptables rules of before restored"
}

# what a failed run shows last (the test keeps only the end of the output): every service's last lines, then the
# warnings and errors of the worker and the API, whole, in $WORK/logs
report_failure() {
  echo "---- compose ps / logs (last lines)"
  compose ps
  compose logs --no-color > "$WORK/logs" 2>&1
  compose logs --no-color --tail 30
  echo "---- health checks that do not pass (their last outputs)"
  local service id
  for service in $LONG_RUNNING; do
    id=$(compose ps -q "$service") && [ -n "$id" ] || continue
    docker inspect -f '{{if .State.Health}}{{if ne .State.Health.Status "healthy"}}{{.Name}} {{.State.Health.Status}}:{{range .State.Health.Log}} [{{.ExitCode}}] {{.Output}}{{end}}{{end}}{{end}}' "$id"
  done
  echo "---- warnings and errors of the worker and the API (all of them: $WORK/logs)"
  grep -E "^(worker|api)_1 .*(WARNING|ERROR|Error|Traceback)" "$WORK/logs" | tail -25
}

cleanup() {
  local status=$?
  set +e
  trap - EXIT INT TERM
  if [ -n "$STACK_UP" ]; then
    [ $status = 0 ] || report_failure >&2
    compose down -v --remove-orphans --timeout 20
  fi
  docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | xargs -r docker rm -f >/dev/null 2>&1
  [ -n "$WHEELS_PID" ] && kill "$WHEELS_PID" 2>/dev/null && wait "$WHEELS_PID" 2>/dev/null
  stop_engine
  if [ $status = 0 ]; then rm -rf "$WORK"; else echo "compose smoke failed (exit $status); logs kept in $WORK" >&2; fi
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- images: stand-ins only where a tag is missing and cannot be pulled --------------------------------------------
debian_mirror() {
  { grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
      || true; } | grep -oE 'https?://[^ ]+/debian/?' | grep -v security | head -1 | grep . || echo http://deb.debian.org/debian
}

standin_base() {
  docker image inspect "$STANDIN_BASE" >/dev/null 2>&1 && return
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
  echo "debootstrap bookworm (minbase) from $(debian_mirror)"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$WORK/rootfs" "$(debian_mirror)" > "$WORK/debootstrap.log"
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["bash"]' \
    - "$STANDIN_BASE" >/dev/null
  rm -rf "$WORK/rootfs"
}

# ensure_image TAG STANDIN: the tag as it is, else pulled, else the stand-in built from scripts/standin-images/
ensure_image() {
  local tag=$1 standin=$2
  if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "$tag: present ($(docker image inspect -f '{{index .Config.Labels "org.swarmbatch.standin"}}' "$tag"))"
    return
  fi
  timeout 120 docker pull -q "$tag" && return
  echo "$tag: no registry; building a local stand-in ($standin.Dockerfile)"
  standin_base
  mkdir -p "$WORK/standin/ca"
  cp scripts/standin-images/* "$WORK/standin/"
  cp /usr/local/share/ca-certificates/*.crt "$WORK/standin/ca/" 2>/dev/null || true  # this host's extra CAs
  docker build -q --network host -t "$tag" -f "$WORK/standin/$standin.Dockerfile" "$WORK/standin" >/dev/null
  echo "$tag: $(docker image inspect -f '{{index .Config.Labels "org.swarmbatch.standin"}}' "$tag")"
}

base_images() {
  ensure_image python:3.11-slim python
  ensure_image redis:7-alpine redis
  ensure_image postgres:16-alpine postgres
}

# the build's torch source: the Dockerfile's default (the PyTorch CPU index) where reachable, else pip's local
# find-links folder served on 127.0.0.1 (the build then runs with --network host)
BUILD_ARGS=()
torch_source() {
  if timeout 15 python3 -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=10)" 2>/dev/null; then
    echo "the PyTorch CPU index answers: the Dockerfile's default"
    return
  fi
  local folder port
  folder=$(pip config list 2>/dev/null | sed -nE "s/^(global|:env:)\.find-links='([^' ]+).*/\2/p" | head -1)
  ls "$folder"/torch-2.13.0*.whl >/dev/null 2>&1 \
    || fail "the PyTorch CPU index is unreachable and pip's find-links folder ('$folder') has no torch 2.13.0 wheel"
  # a fixed port where free: the port is in a build argument, and a new value rebuilds every layer after it
  port=$(python3 -c "
import socket
s = socket.socket()
try:
    s.bind(('127.0.0.1', ${SWARMBATCH_SMOKE_WHEELS_PORT:-38411}))
except OSError:
    s.bind(('127.0.0.1', 0))
print(s.getsockname()[1])")
  python3 -m http.server --bind 127.0.0.1 --directory "$folder" "$port" > "$WORK/wheels.log" 2>&1 &
  WHEELS_PID=$!
  BUILD_ARGS=(--network host --build-arg "TORCH_SOURCE=--find-links http://127.0.0.1:$port/")
  echo "the PyTorch CPU index is unreachable: serving $folder on 127.0.0.1:$port (pid $WHEELS_PID)"
}

build_image() {
  docker build "${BUILD_ARGS[@]}" -t "$IMAGE" . > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; fail "docker build"; }
  echo "build steps from cache: $(grep -c 'Using cache' "$WORK/build.log" || true) of $(grep -c '^Step ' "$WORK/build.log" || true)"
}

# ---- the stack -----------------------------------------------------------------------------------------------------
write_env() {
  local ports
  # free ports of this host for everything the stack publishes (others run tests on 127.0.0.1 at the same time)
  read -r -a ports < <(python3 -c "
import socket
socks = [socket.socket() for _ in range(7)]
for s in socks: s.bind(('127.0.0.1', 0))
print(' '.join(str(s.getsockname()[1]) for s in socks))")
  mkdir -p "$WORK/schedules" && chown 10001:10001 "$WORK/schedules"
  API_PORT=${ports[0]} DHT_PORT=${ports[1]} METRICS1=${ports[5]}
  { cat .env.example
    echo "# ---- compose-smoke.sh (the last value wins)"
    echo "POSTGRES_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')"
    echo "API_PORT=$API_PORT"; echo "DHT_PORT=$DHT_PORT"
    echo "SERVER1_PORT=${ports[2]}"; echo "SERVER2_PORT=${ports[3]}"
    echo "SERVER2_METRICS_PORT=${ports[4]}"; echo "SERVER1_METRICS_PORT=$METRICS1"
    echo "SCHEDULES_DIR=$WORK/schedules"
  } > "$WORK/.env"
}

up() {
  STACK_UP=1
  compose up -d --no-build
}

LONG_RUNNING="redis postgres dht server1 server2 worker beat api"
ONE_SHOTS="migrate model swarm-init"
wait_healthy() {
  local deadline=$((SECONDS + TIMEOUT)) service id state code pending
  while :; do
    pending=""
    for service in $LONG_RUNNING; do
      id=$(compose ps -q "$service")
      state=$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$id")
      [ "$state" = "running healthy" ] || pending="$pending $service($state)"
    done
    for service in $ONE_SHOTS; do
      id=$(compose ps -q "$service")
      code=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$id")
      [ "$code" = "exited 0" ] || { [ "${code%% *}" = exited ] && fail "$service exited: $code"; pending="$pending $service($code)"; }
    done
    [ -z "$pending" ] && { compose ps; return; }
    [ $SECONDS -lt $deadline ] || fail "not healthy after ${TIMEOUT} s:$pending"
    sleep 5
  done
}

# the swarm is private: the swarm file lists the four members, and the worker's key is one of them
check_private_swarm() {
  local name peer role
  compose exec -T worker swarmbatch swarm members /swarm/swarm.json | tee "$WORK/members"
  for name in dht server1 server2 worker; do  # each with its role: the worker's key is a client's, it never serves
    role=server; [ $name != worker ] || role=client
    grep -qE " $name  $role\$" "$WORK/members" || fail "$name is not in the swarm file as a $role member"
  done
  compose run --rm --no-deps swarm-init  # a second run (a later `up`) keeps the keys and the file as they are
  compose exec -T worker swarmbatch swarm members /swarm/swarm.json | cmp - "$WORK/members" \
    || fail "a second swarm-init changed the members"
  # docs/deploying.md: a member from another machine is added (and removed) through swarm-init's mounts
  peer=$(compose run --rm --no-deps --entrypoint swarmbatch swarm-init swarm new-key /tmp/gpu1.key | tail -1 | tr -d '\r')
  compose run --rm --no-deps --entrypoint swarmbatch swarm-init swarm add-member /swarm/swarm.json "$peer" --name gpu1 --role server
  # the list is read whole before grep looks at it: `grep -q` stops at its match, and under pipefail the writer's
  # SIGPIPE would fail the pipeline whenever gpu1's (random) peer id does not sort last
  compose exec -T worker swarmbatch swarm members /swarm/swarm.json > "$WORK/members-gpu1"
  grep -q " gpu1  server\$" "$WORK/members-gpu1" || fail "add-member gpu1 did not show: $(cat "$WORK/members-gpu1")"
  compose run --rm --no-deps --entrypoint swarmbatch swarm-init swarm remove-member /swarm/swarm.json gpu1
  compose exec -T worker swarmbatch swarm members /swarm/swarm.json | cmp - "$WORK/members" || fail "remove-member gpu1"
  compose exec -T worker sh -c 'swarmbatch swarm status smollm2 --json --initial-peers "/dns4/dht/tcp/$0/p2p/$(sed "s#.*/##" /dht/multiaddr)"' \
    "$DHT_PORT" > "$WORK/status.json"
  python3 - "$WORK/status.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
access = report["access"]
assert access["private"] and access["key"]["member"], access
assert not report["missing"], report["missing"]
servers = {s["peer_id"] for block in report["blocks"] for s in block["servers"] if s.get("member")}
assert len(servers) == 2, servers
print(f"private swarm: {len(servers)} member servers cover all {report['num_blocks']} blocks; the worker's key is a member")
EOF
}

API_KEY=""
create_key() {
  API_KEY=$(compose exec -T api swarmbatch keys create smoke | tail -1 | tr -d '\r')
  [ -n "$API_KEY" ] || fail "keys create printed no key"
  echo "created an API key (${#API_KEY} characters)"
}

# the job as the API shows it, and its first error lines
job_report() {
  local api="http://127.0.0.1:$API_PORT"
  curl -sS -H "Authorization: Bearer $API_KEY" "$api/v1/batches/$1"
  echo
  curl -sS -H "Authorization: Bearer $API_KEY" "$api/v1/batches/$1/errors" | head -5
}

run_batch() {
  local api="http://127.0.0.1:$API_PORT" job status deadline=$((SECONDS + TIMEOUT))
  python3 -c "
import json
for i, text in enumerate(['The river rose two metres overnight.', 'The bakery opens at six.', 'Bike lanes cut traffic.']):
    print(json.dumps({'custom_id': f'doc-{i}', 'method': 'POST', 'url': '/v1/chat/completions',
                      'body': {'messages': [{'role': 'user', 'content': 'Summarize in one sentence: ' + text}],
                               'max_tokens': 12}}))" > "$WORK/batch.jsonl"
  job=$(curl -sSf -H "Authorization: Bearer $API_KEY" -F file=@"$WORK/batch.jsonl" -F model=smollm2 "$api/v1/batches" \
        | python3 -c "import json, sys; print(json.load(sys.stdin)['id'])")
  echo "submitted job $job to $api"
  while :; do
    status=$(curl -sSf -H "Authorization: Bearer $API_KEY" "$api/v1/batches/$job" \
             | python3 -c "import json, sys; print(json.load(sys.stdin)['status'])")
    case $status in completed) break ;; failed|cancelled|expired) fail "job $job $status: $(job_report "$job")" ;; esac
    [ $SECONDS -lt $deadline ] || fail "job $job still $status after ${TIMEOUT} s: $(job_report "$job")"
    sleep 3
  done
  curl -sSf -H "Authorization: Bearer $API_KEY" "$api/v1/batches/$job/results" > "$WORK/results.jsonl"
  python3 - "$WORK/results.jsonl" <<'EOF'
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
assert len(lines) == 3, lines
for line in lines:
    text = line["response"]["body"]["choices"][0]["message"]["content"]
    assert text.strip(), line
    print(f"{line['custom_id']}: {text.strip()!r}")
EOF
}

check_metrics() {
  curl -sSf "http://127.0.0.1:$METRICS1/metrics" > "$WORK/metrics"
  grep -E '^swarmbatch_server_(state\{state="online"\}|steps_total|tokens_total)' "$WORK/metrics"
  awk '/^swarmbatch_server_steps_total/ { found = $2 > 0 } END { exit !found }' "$WORK/metrics" \
    || fail "server1's /metrics counts no steps after the batch"
}

# a key that is not in the swarm file: the servers refuse it (it lists itself in its own copy of the file, so the
# refusal is the servers', not its own)
check_outsider_refused() {
  local out
  out=$(compose exec -T worker sh -c '
    cp /swarm/swarm.json /tmp/outsider-swarm.json && rm -f /tmp/outsider.key &&
    swarmbatch swarm new-key /tmp/outsider.key > /dev/null &&
    swarmbatch swarm add-member /tmp/outsider-swarm.json /tmp/outsider.key > /dev/null &&
    swarmbatch generate smollm2 "hello" --max-new-tokens 2 --swarm-file /tmp/outsider-swarm.json --identity /tmp/outsider.key \
      --initial-peers "/dns4/dht/tcp/$0/p2p/$(sed "s#.*/##" /dht/multiaddr)"; echo "exit $?"' "$DHT_PORT" 2>&1)
  echo "$out" | tail -3
  grep -q "not a member of the swarm" <<< "$out" && grep -q "^exit 2$" <<< "$out" \
    || fail "a key outside the swarm file was not refused"
}

run_demo() {
  compose run --rm --no-deps api demo > "$WORK/demo.log" 2>&1 \
    || { tail -30 "$WORK/demo.log" >&2; fail "swarmbatch demo in the image"; }
  grep -E "^Job |documents" "$WORK/demo.log"
  grep -q "^Job completed" "$WORK/demo.log" || fail "the demo's job did not complete"
}

down() {
  compose down -v --remove-orphans --timeout 20
  STACK_UP=""
  local left
  left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"; \
         docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT"; \
         docker network ls -q --filter "label=com.docker.compose.project=$PROJECT")
  [ -z "$left" ] || fail "left after down -v: $left"
  echo "nothing of $PROJECT is left (containers, volumes, networks)"
}

# ---- run -----------------------------------------------------------------------------------------------------------
# (all in one function: bash has read the whole file before anything runs, so editing it meanwhile is safe)
main() {
  step "install the engine (apt) if missing" install_engine
  if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
  step "start dockerd if not running" start_engine
  echo "engine $(docker version -f '{{.Server.Version}}'), compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short 2>/dev/null || true))"
  step "base images (stand-ins where no registry)" base_images
  step "torch source for the build" torch_source
  step "docker build (the project's Dockerfile)" build_image
  step "write .env (free ports, a random password)" write_env
  step "compose up -d" up
  step "every service healthy, one-shots exited 0" wait_healthy
  step "the swarm is private (swarm file, swarm status)" check_private_swarm
  step "keys create in the api container" create_key
  step "a JSONL batch over HTTP completes" run_batch
  step "server1 /metrics" check_metrics
  step "a key outside the swarm file is refused" check_outsider_refused
  step "swarmbatch demo inside the image" run_demo
  step "compose down -v leaves nothing" down

  echo "---- image sizes"
  docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' \
    | grep -E "^(swarmbatch:latest|python:3.11-slim|redis:7-alpine|postgres:16-alpine|$STANDIN_BASE) " || true
  echo "---- time by step"
  printf '%s\n' "${STEPS[@]}"
  printf '%-52s %7s s\n' "total" "$(elapsed "$BEGAN")"
}

main "$@"; exit  # on this line: bash reads no further, even if the file changed meanwhile
