#!/usr/bin/env bash
# Run one kvgraft_jax flagfile as a batch job on every worker of a Cloud TPU VM.
#
#   launch/tpu_vm.sh --name=kv-v5e --zone=us-west4-a --type=v5litepod-8 \
#     --flagfile=configs/tpu/gemma3_270m_v5e8.flags [--project=P] [--queue] [--dry-run] \
#     [-- --artifact=gs://BUCKET/doc ...]   (flags after -- follow the flagfile, so they win)
#
# Steps: create the TPU VM (or queue it with --queue) unless it exists; copy this checkout (git
# HEAD) to every worker; install the package there (the CPU lock plus the `tpu` extra's jax[tpu]
# pin, as BUILD.md says); run `python -m kvgraft_jax.main --flagfile=...` on all workers at once,
# one log per worker under --logs; stop every worker on the first failure; copy worker 0's runs/
# back to --reports. --dry-run prints every command instead of running it.
set -euo pipefail

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  echo "options: --name --zone --type --flagfile (required); --project --version --workers"
  echo "         --logs=DIR (default launch-logs) --reports=DIR (default launch-reports)"
  echo "         --queue --dry-run --help"
}

die() {
  echo "tpu_vm.sh: error: $*" >&2
  exit 2
}

NAME="" ZONE="" TYPE="" FLAGFILE="" PROJECT="" WORKERS=""
VERSION="v2-alpha-tpuv5-lite"
LOGS="launch-logs" REPORTS="launch-reports"
QUEUE=0 DRY_RUN=0
EXTRA=()
while (($#)); do
  arg="$1"
  shift
  case "$arg" in
    --) EXTRA=("$@"); break ;;
    --name=*) NAME="${arg#*=}" ;;
    --zone=*) ZONE="${arg#*=}" ;;
    --type=*) TYPE="${arg#*=}" ;;
    --flagfile=*) FLAGFILE="${arg#*=}" ;;
    --project=*) PROJECT="${arg#*=}" ;;
    --version=*) VERSION="${arg#*=}" ;;
    --workers=*) WORKERS="${arg#*=}" ;;
    --logs=*) LOGS="${arg#*=}" ;;
    --reports=*) REPORTS="${arg#*=}" ;;
    --queue) QUEUE=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --help | -h) usage; exit 0 ;;
    *) die "unknown argument $arg (see --help)" ;;
  esac
done
[[ -n "$NAME" && -n "$ZONE" && -n "$TYPE" && -n "$FLAGFILE" ]] ||
  die "--name, --zone, --type and --flagfile are required (see --help)"
[[ -z "$WORKERS" || "$WORKERS" =~ ^[1-9][0-9]*$ ]] || die "--workers must be a positive integer"
cd "$(dirname "$0")/.."
[[ -f "$FLAGFILE" ]] || die "--flagfile=$FLAGFILE: no such file (paths are relative to the repo root)"

COMMON=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && COMMON+=(--project="$PROJECT")
REMOTE_DIR="kvgraft"
ACTIVATE="cd $REMOTE_DIR && . .venv/bin/activate"
JOB="python -m kvgraft_jax.main --flagfile=$FLAGFILE"
if ((${#EXTRA[@]})); then JOB+=$(printf ' %q' "${EXTRA[@]}"); fi

# Prints a command (dry run) or runs it; either way the command is shown first.
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [[ "$DRY_RUN" == 0 ]]; then
    "$@"
  fi
}

tpu_ssh() {
  local worker="$1" command="$2"
  run gcloud compute tpus tpu-vm ssh "$NAME" "${COMMON[@]}" --worker="$worker" --command="$command"
}

# 1. The TPU VM: reuse it, create it, or queue it and wait until it is ACTIVE.
if [[ "$DRY_RUN" == 0 ]] && gcloud compute tpus tpu-vm describe "$NAME" "${COMMON[@]}" >/dev/null 2>&1; then
  echo "using the existing TPU VM $NAME"
elif [[ "$QUEUE" == 1 ]]; then
  run gcloud compute tpus queued-resources create "$NAME-request" "${COMMON[@]}" \
    --node-id="$NAME" --accelerator-type="$TYPE" --runtime-version="$VERSION"
  if [[ "$DRY_RUN" == 0 ]]; then
    until [[ "$(gcloud compute tpus queued-resources describe "$NAME-request" "${COMMON[@]}" \
      --format='value(state.state)')" == "ACTIVE" ]]; do
      echo "waiting for the queued TPU $NAME ..."
      sleep 60
    done
  fi
else
  run gcloud compute tpus tpu-vm create "$NAME" "${COMMON[@]}" \
    --accelerator-type="$TYPE" --version="$VERSION"
fi

# 2. How many workers (hosts) the slice has.
if [[ -z "$WORKERS" ]]; then
  if [[ "$DRY_RUN" == 1 ]]; then
    WORKERS=1
  else
    endpoints="$(gcloud compute tpus tpu-vm describe "$NAME" "${COMMON[@]}" \
      --format='value(networkEndpoints[].ipAddress)')"
    WORKERS="$(tr ';' '\n' <<<"$endpoints" | grep -c .)"
  fi
fi
echo "$NAME: $WORKERS worker(s)"

# 3. This checkout, as committed, on every worker; 4. the install.
ARCHIVE="$(mktemp -t kvgraft-XXXXXX.tar.gz)"
trap 'rm -f "$ARCHIVE"' EXIT
run git archive --format=tar.gz --output="$ARCHIVE" HEAD
run gcloud compute tpus tpu-vm scp "$ARCHIVE" "$NAME:kvgraft.tar.gz" "${COMMON[@]}" --worker=all
tpu_ssh all "mkdir -p $REMOTE_DIR && tar -xzf kvgraft.tar.gz -C $REMOTE_DIR"
tpu_ssh all "cd $REMOTE_DIR && python3.11 -m venv .venv && . .venv/bin/activate && \
pip install --no-deps -r requirements/cpu.lock -e . && pip install 'jax[tpu]==0.9.2'"

# 5. The job on every worker at once, one log each; the first failure stops them all.
if [[ "$DRY_RUN" == 0 ]]; then mkdir -p "$LOGS"; fi
pids=()
set -m # each worker's job in its own process group, so a failure can stop all of it
for ((worker = 0; worker < WORKERS; worker++)); do
  log="$LOGS/worker-$worker.log"
  echo "worker $worker -> $log"
  if [[ "$DRY_RUN" == 1 ]]; then
    tpu_ssh "$worker" "$ACTIVATE && $JOB"
  else
    tpu_ssh "$worker" "$ACTIVATE && $JOB" >"$log" 2>&1 &
    pids+=("$!")
  fi
done
set +m
failed=0
for ((done = 0; done < ${#pids[@]}; done++)); do
  if ! wait -n "${pids[@]}"; then
    failed=1
    break
  fi
done
if [[ "$failed" == 1 ]]; then
  echo "a worker failed: stopping the others (logs in $LOGS/)" >&2
  for pid in "${pids[@]}"; do
    kill -- "-$pid" 2>/dev/null || true
  done
  run gcloud compute tpus tpu-vm ssh "$NAME" "${COMMON[@]}" --worker=all \
    --command="pkill -f kvgraft_jax.main || true" || true
  exit 1
fi

# 6. Reports back from worker 0 (process 0 writes them).
if [[ "$DRY_RUN" == 0 ]]; then mkdir -p "$REPORTS"; fi
run gcloud compute tpus tpu-vm scp --recurse "$NAME:$REMOTE_DIR/runs" "$REPORTS/" "${COMMON[@]}" --worker=0
echo "done: logs in $LOGS/, reports in $REPORTS/"
