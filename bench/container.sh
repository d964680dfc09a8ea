#!/usr/bin/env bash
# The Dockerfile's `cpu` image, built with podman and walked as a user would (issue 31, item 14). On demand, as
# root, on a Debian host with `apt-get install podman debootstrap`; not part of `make test` (it takes a quarter of an
# hour on two cores). From anywhere:
#
#   bash bench/container.sh                  # build (layers cached), run, walk, remove the container and volume
#   NO_CACHE=1 bash bench/container.sh       # the build from scratch, as its timing in the README was taken
#   KEEP=1 bash bench/container.sh           # leave the container and its volume running afterwards
#
# The walk: the image is built (time, size); the container starts with a named volume on /data and an admin
# password; the engine answers /healthz, then /readyz once vLLM serves the demo model (trained at first start);
# the admin signs in through the engine's API as the console does (a wrong password: 401); the console serves its
# page at 8501 and, where Chromium and Playwright are here, signs in in a browser; a gateway key made with
# `podman exec … llmops token create` completes text on /v1 (no key: 401); a settings change is written; then
# `podman restart`, and the key, the setting, the admin's password and the demo model are all still there.
# Every step prints its time; any failed step prints the container's log and exits non-zero.
#
# The base: python:3.11-slim-bookworm where docker.io answers, else a Debian bookworm made here with debootstrap
# (localhost/bookworm-python:3.11: python3 with its venv module and headers, as the official image has, and this
# host's CA bundle, so that a TLS-intercepting proxy stays trusted) passed as the Dockerfile's PYTHON_IMAGE.
# torch 2.13.0+cpu comes from PyTorch's CPU index where it answers, else from a local wheel folder (WHEELS, default
# /opt/wheels) mounted into the build. Where the default OCI settings cannot
# start a container (a sandbox without CAP_SYS_RESOURCE, cgroups v1+v2 hybrid that crun refuses) the script says
# why and retries with runc and this host's own limits (a containers.conf of its own, nothing installed).
#
# Settings (environment): IMAGE (localhost/llmops-console:cpu), PYTHON_IMAGE (the base, chosen as above),
# WHEELS (/opt/wheels), ENGINE_PORT (18000), CONSOLE_PORT (18501), READY_TIMEOUT_S (1200), NO_CACHE, KEEP.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/llmops-console:cpu}
LOCAL_BASE=localhost/bookworm-python:3.11
WHEELS=${WHEELS:-/opt/wheels}
ENGINE_PORT=${ENGINE_PORT:-18000}
CONSOLE_PORT=${CONSOLE_PORT:-18501}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-1200}
NAME=llmops-walk-$$
VOLUME=llmops-walk-data-$$
PASSWORD="walk-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
ENGINE=http://127.0.0.1:$ENGINE_PORT
CONSOLE=http://127.0.0.1:$CONSOLE_PORT
WORK=$(mktemp -d)
T0=$SECONDS
STEP_T0=$SECONDS

say() { printf '[%4ds] %s\n' $((SECONDS - T0)) "$*"; }
step() { STEP_T0=$SECONDS; say "== $*"; }
ok() { say "   ok ($((SECONDS - STEP_T0)) s): $*"; }
fail() {
  say "FAILED: $*" >&2
  if podman container exists "$NAME" 2>/dev/null; then
    echo "--- last 60 lines of the container's log ---" >&2
    podman logs --tail 60 "$NAME" >&2 2>&1 || true
  fi
  exit 1
}
cleanup() {
  local rc=$?
  if [[ -n ${KEEP:-} ]] && podman container exists "$NAME" 2>/dev/null; then
    say "kept: container $NAME (engine $ENGINE, console $CONSOLE, admin password $PASSWORD), volume $VOLUME"
  else
    podman rm -f -t 10 "$NAME" >/dev/null 2>&1 || true
    podman volume rm -f "$VOLUME" >/dev/null 2>&1 || true
  fi
  rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # the cleanup runs on Ctrl-C too

# HTTP status of a request (000 when nothing answers); the body goes to $WORK/body.
http() { curl -s -o "$WORK/body" -w '%{http_code}' --max-time 30 "$@" || true; }
json() { python3 -c "import json,sys; d=json.load(open('$WORK/body')); print($1)"; }
applied() {  # until GET /api/settings says revision $1 is applied (the engine runs it)
  local deadline=$((SECONDS + READY_TIMEOUT_S)) state
  while :; do
    [[ $(http -H "authorization: Bearer $SESSION" "$ENGINE/api/settings") == 200 ]] || fail "GET /api/settings"
    state="$(json 'd["revision"]') $(json 'd["status"]')"
    [[ $state == "$1 applied" ]] && return
    [[ $state == *rejected ]] && fail "revision $1 was rejected: $(json 'd["status_reason"]')"
    ((SECONDS < deadline)) || fail "revision $1 not applied within $READY_TIMEOUT_S s (now: $state)"
    sleep 3
  done
}
wait_for() {  # URL STATUS TIMEOUT_S: until URL answers STATUS; the container must stay up meanwhile
  local deadline=$((SECONDS + $3))
  until [[ $(http "$1") == "$2" ]]; do
    [[ $(podman inspect -f '{{.State.Running}}' "$NAME" 2>/dev/null) == true ]] || fail "the container stopped"
    ((SECONDS < deadline)) || fail "$1 did not answer $2 within $3 s (last: $(head -c 300 "$WORK/body" 2>/dev/null))"
    sleep 3
  done
}

# ---- podman itself: can it start a container here? ----------------------------------------------------------
command -v podman >/dev/null || { echo "podman is missing: apt-get install podman" >&2; exit 2; }
try_run() { podman run --rm --network none "$1" true 2>"$WORK/run.err"; }

# ---- the base image ----------------------------------------------------------------------------------------------
step "base image"
if [[ -z ${PYTHON_IMAGE:-} ]]; then
  if curl -s -o /dev/null --max-time 10 https://registry-1.docker.io/v2/; then
    PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm
  else
    PYTHON_IMAGE=$LOCAL_BASE
    say "   docker.io does not answer: the base is $LOCAL_BASE, made here with debootstrap"
  fi
fi
if [[ $PYTHON_IMAGE == "$LOCAL_BASE" ]] && ! podman image exists "$LOCAL_BASE"; then
  command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 2; }
  root=$WORK/rootfs
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates bookworm "$root" \
    http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; fail debootstrap; }
  cat >"$root/etc/apt/sources.list" <<'EOF'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"  # this host's trust store
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import -q --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' --change 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$root"
fi
podman image exists "$PYTHON_IMAGE" || podman pull -q "$PYTHON_IMAGE" >/dev/null || fail "cannot pull $PYTHON_IMAGE"
ok "$PYTHON_IMAGE"

step "podman can start a container"
if ! try_run "$PYTHON_IMAGE"; then
  say "   not with the defaults: $(tail -1 "$WORK/run.err")"
  # No CAP_SYS_RESOURCE: the default rlimits (nofile 1048576) cannot be set; crun refuses cgroups v1+v2 hybrid.
  cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$(( $(ulimit -Hu) < 32768 ? $(ulimit -Hu) : 32768 )):$(( $(ulimit -Hu) < 32768 ? $(ulimit -Hu) : 32768 ))"]
[engine]
runtime = "runc"
EOF
  export CONTAINERS_CONF=$WORK/containers.conf
  command -v runc >/dev/null || fail "and runc, the fallback, is missing: apt-get install runc"
  try_run "$PYTHON_IMAGE" || fail "not with runc and this host's limits either: $(tail -1 "$WORK/run.err")"
  say "   with runc and this host's limits ($WORK/containers.conf)"
fi
ok "podman $(podman version -f '{{.Client.Version}}'), $(podman info -f '{{.Host.OCIRuntime.Name}}'), \
$(podman info -f '{{.Store.GraphDriverName}}') storage"

# ---- build -----------------------------------------------------------------------------------------------------
step "build --target cpu"
# --format docker: the OCI image format has no HEALTHCHECK, and podman drops it (with a warning) by default
build=(podman build --format docker --target cpu -t "$IMAGE" --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
[[ -n ${NO_CACHE:-} ]] && build+=(--no-cache)
if ! curl -s -o /dev/null --max-time 10 https://download.pytorch.org/whl/cpu/torch/; then
  compgen -G "$WHEELS/torch-2.13.0+cpu*.whl" >/dev/null \
    || fail "download.pytorch.org does not answer and $WHEELS has no torch-2.13.0+cpu wheel (WHEELS=...)"
  say "   download.pytorch.org does not answer: torch from $WHEELS"
  build+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=)
fi
"${build[@]}" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; fail "the build"; }
BUILD_S=$((SECONDS - STEP_T0))
SIZE=$(podman image inspect -f '{{.Size}}' "$IMAGE")
ok "$IMAGE: built in $((BUILD_S / 60)) min $((BUILD_S % 60)) s; $(podman images --format '{{.Size}}' "$IMAGE") \
($((SIZE / 1000000)) MB)"

# ---- first start ---------------------------------------------------------------------------------------------
step "run: named volume on /data, ports $ENGINE_PORT and $CONSOLE_PORT"
podman volume create "$VOLUME" >/dev/null
RUN_T0=$SECONDS
# --shm-size: vLLM's engine core wants ~160 MiB of /dev/shm; a container gets 64 MiB by default
podman run -d --name "$NAME" --shm-size 1g -p "127.0.0.1:$ENGINE_PORT:8000" -p "127.0.0.1:$CONSOLE_PORT:8501" \
  -v "$VOLUME:/data" -e "LLMOPS_ADMIN_PASSWORD=$PASSWORD" "$IMAGE" >/dev/null 2>"$WORK/run.err" \
  || { cat "$WORK/run.err"; fail "podman run"; }  # (without systemd podman logs that it cannot time HEALTHCHECK)
[[ $(podman exec "$NAME" id -u) == 1000 ]] || fail "the container does not run as the llmops user (uid 1000)"
ok "container $NAME, user llmops (uid 1000)"

step "engine answers /healthz (first start: the demo model is trained before the engine starts)"
wait_for "$ENGINE/healthz" 200 "$READY_TIMEOUT_S"
ok "/healthz 200"

step "engine /readyz: vLLM serves the demo model"
wait_for "$ENGINE/readyz" 200 "$READY_TIMEOUT_S"
FIRST_READY_S=$((SECONDS - RUN_T0))
ok "/readyz 200"
podman healthcheck run "$NAME" >/dev/null || fail "the image's HEALTHCHECK says unhealthy"
say "   the image's HEALTHCHECK: healthy"

step "sign-in: POST /api/auth/login as the console does"
[[ $(http -X POST -H 'content-type: application/json' -d '{"username":"admin","password":"not-it"}' \
  "$ENGINE/api/auth/login") == 401 ]] || fail "a wrong password was not refused with 401"
code=$(http -X POST -H 'content-type: application/json' \
  -d "{\"username\":\"admin\",\"password\":\"$PASSWORD\"}" "$ENGINE/api/auth/login")
[[ $code == 200 ]] || fail "sign-in answered $code: $(cat "$WORK/body")"
SESSION=$(json 'd["token"]')
[[ $(http -H "authorization: Bearer $SESSION" "$ENGINE/api/auth/me") == 200 && $(json 'd["role"]') == admin ]] \
  || fail "the session token is not the admin's"
ok "admin signed in (wrong password: 401)"

step "console serves at $CONSOLE"
wait_for "$CONSOLE/_stcore/health" 200 120
[[ $(http "$CONSOLE/") == 200 ]] && grep -qi streamlit "$WORK/body" || fail "the console's page is not served"
ok "/_stcore/health 200, / 200"
PY=.venv/bin/python
if [[ -x /usr/bin/chromium && -x $PY ]] && $PY -c "import playwright" 2>/dev/null; then
  CONSOLE=$CONSOLE PASSWORD=$PASSWORD SHOT=$WORK/console.png timeout 180 $PY - <<'EOF' || fail "browser sign-in"
import os
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
    pg = b.new_page(viewport={"width": 1440, "height": 1000})
    pg.set_default_timeout(60_000)
    pg.goto(os.environ["CONSOLE"])
    pg.get_by_label("User").fill("admin")
    pg.get_by_label("Password", exact=True).fill(os.environ["PASSWORD"])
    pg.get_by_role("button", name="Sign in").click()
    pg.get_by_role("heading", name="Overview", level=1).wait_for()
    b.close()
EOF
  ok "Chromium: signed in as admin, the Overview page shows"
else
  say "   (no browser check: needs /usr/bin/chromium and Playwright in .venv)"
fi

step "gateway key: podman exec … llmops token create --role prompter --kind gateway"
KEY=$(podman exec "$NAME" llmops token create --role prompter --kind gateway --name container-walk 2>/dev/null)
[[ -n $KEY ]] || fail "no key printed"
[[ $(http -H "authorization: Bearer $KEY" "$ENGINE/v1/models") == 200 ]] || fail "/v1/models with the key"
MODEL=$(json 'd["data"][0]["id"]')
complete() {  # KEY: POST /v1/completions, status out
  http -X POST -H 'content-type: application/json' ${1:+-H "authorization: Bearer $1"} \
    -d "{\"model\":\"$MODEL\",\"prompt\":\"This module provides\",\"max_tokens\":8,\"temperature\":0}" \
    "$ENGINE/v1/completions"
}
[[ $(complete "") == 401 ]] || fail "/v1/completions without a key was not refused with 401"
code=$(complete "$KEY")
[[ $code == 200 ]] || fail "/v1/completions with the key answered $code: $(head -c 300 "$WORK/body")"
ok "model $MODEL; no key: 401; with the key: 200 \"$(json 'd["choices"][0]["text"]' | tr '\n' ' ')\""

step "a settings change: max_num_seqs=3"
podman exec "$NAME" llmops settings set max_num_seqs=3 --yes --note "container walk" >"$WORK/set.log" 2>&1 \
  || { cat "$WORK/set.log"; fail "llmops settings set"; }
[[ $(http -H "authorization: Bearer $SESSION" "$ENGINE/api/settings") == 200 ]] || fail "GET /api/settings"
REVISION=$(json 'd["revision"]')
[[ $(json 'd["values"]["max_num_seqs"]') == 3 ]] || fail "the new revision does not hold max_num_seqs=3"
applied "$REVISION"
[[ $(complete "$KEY") == 200 ]] || fail "/v1/completions after the apply: $(head -c 300 "$WORK/body")"
ok "revision $REVISION written and applied; /v1 answers"

# ---- restart: does the data survive? ----------------------------------------------------------------------
step "podman restart"
podman restart -t 60 "$NAME" >/dev/null 2>"$WORK/run.err" || { cat "$WORK/run.err"; fail "podman restart"; }
wait_for "$ENGINE/healthz" 200 "$READY_TIMEOUT_S"
wait_for "$ENGINE/readyz" 200 "$READY_TIMEOUT_S"
RESTART_S=$((SECONDS - STEP_T0))
ok "ready again"

step "after the restart: the key, the setting, the password, the model"
code=$(complete "$KEY")
[[ $code == 200 ]] || fail "the key no longer works: $code $(head -c 300 "$WORK/body")"
code=$(http -X POST -H 'content-type: application/json' \
  -d "{\"username\":\"admin\",\"password\":\"$PASSWORD\"}" "$ENGINE/api/auth/login")
[[ $code == 200 ]] || fail "the admin's sign-in answered $code after the restart"
SESSION=$(json 'd["token"]')
[[ $(http -H "authorization: Bearer $SESSION" "$ENGINE/api/settings") == 200 ]] || fail "GET /api/settings"
[[ $(json 'd["revision"]') == "$REVISION" && $(json 'd["values"]["max_num_seqs"]') == 3 ]] \
  || fail "the settings revision is not $REVISION with max_num_seqs=3: $(head -c 300 "$WORK/body")"
applied "$REVISION"
podman logs "$NAME" 2>&1 | grep -q "demo model already at" || fail "the demo model was trained again"
ok "key 200, admin signs in, revision $REVISION (max_num_seqs=3) applied, demo model kept"

say "done: build $((BUILD_S / 60)) min $((BUILD_S % 60)) s, image $((SIZE / 1000000)) MB, first start to ready \
${FIRST_READY_S} s, restart to ready ${RESTART_S} s, all in $((SECONDS - T0)) s"
