#!/usr/bin/env bash
# Run grpo_jax on a Cloud TPU VM slice: create it, install, run the same command on every
# worker, stream worker 0's log, collect every worker's log, delete the slice.
#
#   scripts/launch_tpu_pod.sh --name=grpo-8b --zone=us-east5-a --type=v5p-64 \
#       --workdir=/mnt/gcs/runs/8b_rollout_gdro --gcs-bucket=my-bucket \
#       -- --config=configs/dapo_qwen3.py:8b,rollout_gdro --config.model.hf_checkpoint=/home/$USER/qwen3-8b
#
# Everything after `--` is passed to `python -m experiments.run` on every worker (with
# --workdir and --distributed=on added). `--dry-run` prints the commands and runs nothing.
#
# The workdir must be the SAME shared directory on every worker (Orbax writes each process's
# shards there and process 0 commits): with --gcs-bucket the bucket is mounted with gcsfuse at
# /mnt/gcs on every worker. The JAX compilation cache goes to <workdir>/../jax_cache, so a
# restarted job skips compilation. Data and checkpoints that must be local are copied by
# --setup (a command run on every worker after the install, e.g. `gcloud storage cp -r ...`).
set -euo pipefail

NAME=""
ZONE=""
TYPE="v5p-8"
RUNTIME=""                 # TPU software version; default by generation below
PROJECT=""
WORKDIR=""
GCS_BUCKET=""
SETUP=""
SPOT=0
KEEP=0
DRY_RUN=0
EXTRA_PIP=""
RUN_ARGS=()

usage() {
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
Options:
  --name=NAME            TPU VM name (required)
  --zone=ZONE            zone (required), e.g. us-east5-a (v5p), us-east1-d (v6e)
  --type=TYPE            accelerator type, e.g. v5p-8 (4 chips, 1 host), v5p-64 (32 chips, 8 hosts), v6e-32
  --runtime=VERSION      TPU software version (default: v2-alpha-tpuv5 for v5p/v5e, v2-alpha-tpuv6e for v6e, tpu-ubuntu2204-base for v4)
  --project=PROJECT      gcloud project (default: gcloud's)
  --workdir=DIR          run directory, shared by all workers (required)
  --gcs-bucket=BUCKET    mount gs://BUCKET at /mnt/gcs on every worker (gcsfuse)
  --setup=CMD            shell command run on every worker after installing (copy data, weights)
  --pip=PKGS             extra pip packages to install on the workers
  --spot                 create a Spot slice
  --keep                 do not delete the slice at the end
  --dry-run              print the commands, run nothing
EOF
}

for arg in "$@"; do
  shift
  case "$arg" in
    --name=*) NAME="${arg#*=}" ;;
    --zone=*) ZONE="${arg#*=}" ;;
    --type=*) TYPE="${arg#*=}" ;;
    --runtime=*) RUNTIME="${arg#*=}" ;;
    --project=*) PROJECT="${arg#*=}" ;;
    --workdir=*) WORKDIR="${arg#*=}" ;;
    --gcs-bucket=*) GCS_BUCKET="${arg#*=}" ;;
    --setup=*) SETUP="${arg#*=}" ;;
    --pip=*) EXTRA_PIP="${arg#*=}" ;;
    --spot) SPOT=1 ;;
    --keep) KEEP=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) usage; exit 0 ;;
    --) RUN_ARGS=("$@"); break ;;
    *) echo "error: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

[[ -n "$NAME" ]] || { echo "error: --name is required" >&2; exit 2; }
[[ -n "$ZONE" ]] || { echo "error: --zone is required" >&2; exit 2; }
[[ -n "$WORKDIR" ]] || { echo "error: --workdir is required (a directory every worker shares)" >&2; exit 2; }
[[ ${#RUN_ARGS[@]} -gt 0 ]] || { echo "error: give the experiments.run flags after --, e.g. -- --config=configs/dapo_qwen3.py:8b,grpo" >&2; exit 2; }
if [[ -z "$RUNTIME" ]]; then
  case "$TYPE" in
    v5p-*|v5litepod-*|v5e-*) RUNTIME="v2-alpha-tpuv5" ;;
    v6e-*) RUNTIME="v2-alpha-tpuv6e" ;;
    v4-*) RUNTIME="tpu-ubuntu2204-base" ;;
    *) echo "error: --type=$TYPE: give --runtime" >&2; exit 2 ;;
  esac
fi

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GCLOUD=(gcloud compute tpus tpu-vm)
COMMON=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && COMMON+=(--project="$PROJECT")
TARBALL="/tmp/grpo_jax_${NAME}.tar.gz"
REMOTE_DIR="grpo_jax"

# print (dry run) or run a command
run() {
  if [[ $DRY_RUN -eq 1 ]]; then
    printf '%q ' "$@"
    printf '\n'
  else
    "$@"
  fi
}

on_all_workers() {
  run "${GCLOUD[@]}" ssh "$NAME" "${COMMON[@]}" --worker=all --command="$1"
}

cleanup() {
  local status=$?
  if [[ $KEEP -eq 0 ]]; then
    echo "deleting $NAME" >&2
    run "${GCLOUD[@]}" delete "$NAME" "${COMMON[@]}" --quiet || true
  else
    echo "keeping $NAME (delete with: ${GCLOUD[*]} delete $NAME ${COMMON[*]} --quiet)" >&2
  fi
  exit "$status"
}

# 1. create the slice (deleted on exit, success or not, unless --keep)
CREATE=("${GCLOUD[@]}" create "$NAME" "${COMMON[@]}" --accelerator-type="$TYPE" --version="$RUNTIME")
[[ $SPOT -eq 1 ]] && CREATE+=(--spot)
run "${CREATE[@]}"
trap cleanup EXIT INT TERM

# 2. ship the code (the committed tree) and install it on every worker
run git -C "$REPO_ROOT" archive --format=tar.gz --prefix="$REMOTE_DIR/" -o "$TARBALL" HEAD
run "${GCLOUD[@]}" scp "$TARBALL" "$NAME:~/grpo_jax.tar.gz" "${COMMON[@]}" --worker=all
INSTALL="set -e; rm -rf ~/$REMOTE_DIR; tar xzf ~/grpo_jax.tar.gz -C ~; cd ~/$REMOTE_DIR"
INSTALL+="; python3 -m pip install -q -U pip; python3 -m pip install -q -e . 'jax[tpu]' $EXTRA_PIP"
if [[ -n "$GCS_BUCKET" ]]; then
  INSTALL+="; (command -v gcsfuse >/dev/null || (sudo apt-get update -q && sudo apt-get install -y -q gcsfuse))"
  INSTALL+="; sudo mkdir -p /mnt/gcs && sudo chown \$USER /mnt/gcs"
  INSTALL+="; mountpoint -q /mnt/gcs || gcsfuse --implicit-dirs $GCS_BUCKET /mnt/gcs"
fi
[[ -n "$SETUP" ]] && INSTALL+="; $SETUP"
on_all_workers "$INSTALL"

# 3. the same command on every worker, detached (an ssh drop does not kill the job);
#    jax.distributed.initialize() reads the slice's topology on TPU VMs (no coordinator flags).
QUOTED_ARGS="$(printf '%q ' "${RUN_ARGS[@]}")"
JOB="cd ~/$REMOTE_DIR && mkdir -p $(printf '%q' "$WORKDIR")"
JOB+=" && export JAX_COMPILATION_CACHE_DIR=$(printf '%q' "$(dirname "$WORKDIR")/jax_cache")"
JOB+=" && nohup python3 -m experiments.run --distributed=on --workdir=$(printf '%q' "$WORKDIR") $QUOTED_ARGS"
JOB+=" > ~/grpo_run.\$(hostname).log 2>&1 < /dev/null & echo \$! > ~/grpo_run.pid"
on_all_workers "$JOB"

# 4. stream worker 0's log until its process exits, then fetch every worker's log and exit code
run "${GCLOUD[@]}" ssh "$NAME" "${COMMON[@]}" --worker=0 \
  --command="tail --pid=\$(cat ~/grpo_run.pid) -n +1 -F ~/grpo_run.\$(hostname).log"
run mkdir -p "logs/$NAME"
run "${GCLOUD[@]}" scp "$NAME:~/grpo_run.*.log" "logs/$NAME/" "${COMMON[@]}" --worker=all || true
echo "logs of every worker: logs/$NAME/ (a hang is usually one worker that failed early: read them all)" >&2
