#!/usr/bin/env bash
# Run grpo_jax across GPU nodes with Slurm: one process per node, each driving its node's GPUs,
# joined by jax.distributed (coordinator = the first node of the allocation).
#
#   scripts/launch_gpu_slurm.sh --nodes=1 --gpus-per-node=8 --partition=gpu --time=24:00:00 \
#       --venv=/shared/venvs/grpo --workdir=/shared/runs/8b_rollout_gdro \
#       -- --config=configs/dapo_qwen3.py:8b,rollout_gdro \
#          --config.algorithm.micro_batch_size=8 --config.rollout.generate_batch_size=256 \
#          --config.model.hf_checkpoint=/shared/models/Qwen3-8B-Base
#
# These are the settings XLA:GPU compiled for one node (reports/aot.md, "The real GPU
# compiler"; compiled for GPU, not run): the paper's Qwen3-8B step on 8 x H100 with FSDP over
# the 8 GPUs, micro-batches of 8 rollouts and sampler calls of 256 rows peaks at 43.2 GiB per
# GPU (the sampler's); on 8 x H200 sampler calls of 512 rows halve the calls. Two nodes:
# --nodes=2 and --config.mesh.data=2 --config.algorithm.micro_batch_size=16
# --config.rollout.generate_batch_size=512 (data parallel across the nodes, FSDP within each:
# the same 43.2 GiB per GPU, weight gathers on NVLink). Check another layout or node count
# first: python -m experiments.aot --topology=h100-16 --mesh=2,8,1 ... (pip install -e
# ".[gpu_aot]"; no GPU needed).
#
# Everything after `--` goes to `python -m experiments.run` on every node (with --workdir and
# the coordinator flags added). Outside an allocation the script submits itself with sbatch
# (`--follow` streams the log); inside one (salloc, or an sbatch script) it runs srun directly.
# `--dry-run` prints the batch script and the srun command and runs nothing.
#
# The repository, the virtualenv and the workdir must be on a filesystem every node mounts
# at the same path (Orbax writes each process's shards to the workdir). The JAX compilation
# cache goes to <workdir>/../jax_cache. Each process logs to <workdir>/logs/<job>.<rank>.log.
set -euo pipefail

NODES=1
GPUS_PER_NODE=8
PARTITION=""
ACCOUNT=""
TIME="24:00:00"
VENV=""
WORKDIR=""
PORT=""
FOLLOW=0
DRY_RUN=0
RUN_ARGS=()

usage() {
  sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
Options:
  --nodes=N              nodes (one process each)                    [1]
  --gpus-per-node=G      GPUs per node                               [8]
  --partition=P          Slurm partition
  --account=A            Slurm account
  --time=HH:MM:SS        time limit                                  [24:00:00]
  --venv=DIR             virtualenv to activate on every node (shared path)
  --workdir=DIR          run directory, shared by every node (required)
  --port=PORT            coordinator port (default: 20000 + job id % 20000)
  --follow               after sbatch, stream the job's log
  --dry-run              print what would run, run nothing
EOF
}

for arg in "$@"; do
  shift
  case "$arg" in
    --nodes=*) NODES="${arg#*=}" ;;
    --gpus-per-node=*) GPUS_PER_NODE="${arg#*=}" ;;
    --partition=*) PARTITION="${arg#*=}" ;;
    --account=*) ACCOUNT="${arg#*=}" ;;
    --time=*) TIME="${arg#*=}" ;;
    --venv=*) VENV="${arg#*=}" ;;
    --workdir=*) WORKDIR="${arg#*=}" ;;
    --port=*) PORT="${arg#*=}" ;;
    --follow) FOLLOW=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) usage; exit 0 ;;
    --) RUN_ARGS=("$@"); break ;;
    *) echo "error: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

[[ -n "$WORKDIR" ]] || { echo "error: --workdir is required (a directory every node shares)" >&2; exit 2; }
[[ ${#RUN_ARGS[@]} -gt 0 ]] || { echo "error: give the experiments.run flags after --, e.g. -- --config=configs/dapo_qwen3.py:8b,grpo,gpu8" >&2; exit 2; }
[[ "$NODES" =~ ^[0-9]+$ && "$NODES" -ge 1 ]] || { echo "error: --nodes=$NODES must be a positive integer" >&2; exit 2; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The per-node command (runs under srun; $SLURM_* are expanded on each node).
node_command() {
  local args
  args="$(printf '%q ' "${RUN_ARGS[@]}")"
  local activate=""
  [[ -n "$VENV" ]] && activate="source $(printf '%q' "$VENV")/bin/activate && "
  cat <<EOF
${activate}cd $(printf '%q' "$REPO_ROOT") && \
export XLA_PYTHON_CLIENT_MEM_FRACTION=\${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} && \
export JAX_COMPILATION_CACHE_DIR=$(printf '%q' "$(dirname "$WORKDIR")/jax_cache") && \
exec python -m experiments.run --workdir=$(printf '%q' "$WORKDIR") \
  --coordinator_address=\$GRPO_HEAD:\$GRPO_PORT --num_processes=\$SLURM_NTASKS --process_id=\$SLURM_PROCID \
  $args > $(printf '%q' "$WORKDIR")/logs/\$SLURM_JOB_ID.\$SLURM_PROCID.log 2>&1
EOF
}

# Inside an allocation: srun one task per node.
run_in_allocation() {
  local head port cmd
  head="$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" | head -n 1)"
  port="${PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
  cmd="$(node_command)"
  local srun_cmd=(srun --nodes="$NODES" --ntasks-per-node=1 --gpus-per-node="$GPUS_PER_NODE"
                  --kill-on-bad-exit=1 "--export=ALL,GRPO_HEAD=$head,GRPO_PORT=$port" bash -c "$cmd")
  if [[ $DRY_RUN -eq 1 ]]; then
    printf '%q ' "${srun_cmd[@]}"
    printf '\n# each node runs (GRPO_HEAD=%s GRPO_PORT=%s):\n%s\n' "$head" "$port" "$cmd"
    return 0
  fi
  mkdir -p "$WORKDIR/logs"
  echo "coordinator $head:$port; logs: $WORKDIR/logs/${SLURM_JOB_ID:-}.<rank>.log" >&2
  "${srun_cmd[@]}"
}

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  run_in_allocation
  exit $?
fi

# Outside an allocation: a batch script that re-runs this script inside the allocation.
BATCH="$(mktemp /tmp/grpo_jax_sbatch.XXXXXX)"
{
  echo "#!/usr/bin/env bash"
  echo "#SBATCH --job-name=grpo_jax"
  echo "#SBATCH --nodes=$NODES"
  echo "#SBATCH --ntasks-per-node=1"
  echo "#SBATCH --gpus-per-node=$GPUS_PER_NODE"
  echo "#SBATCH --time=$TIME"
  echo "#SBATCH --output=$WORKDIR/logs/slurm-%j.out"
  [[ -n "$PARTITION" ]] && echo "#SBATCH --partition=$PARTITION"
  [[ -n "$ACCOUNT" ]] && echo "#SBATCH --account=$ACCOUNT"
  ARGS=(--nodes="$NODES" --gpus-per-node="$GPUS_PER_NODE" --workdir="$WORKDIR")
  [[ -n "$VENV" ]] && ARGS+=(--venv="$VENV")
  [[ -n "$PORT" ]] && ARGS+=(--port="$PORT")
  printf '%q ' "$REPO_ROOT/scripts/launch_gpu_slurm.sh" "${ARGS[@]}" -- "${RUN_ARGS[@]}"
  printf '\n'
} > "$BATCH"

if [[ $DRY_RUN -eq 1 ]]; then
  echo "# batch script ($BATCH):"
  cat "$BATCH"
  echo "# submit with:"
  echo "sbatch $BATCH"
  echo "# on the allocation it runs (job 12345 on node0..):"
  (
    SLURM_JOB_ID=12345
    SLURM_JOB_NODELIST=node0
    scontrol() { echo node0; }
    run_in_allocation
  )
  rm -f "$BATCH"
  exit 0
fi

mkdir -p "$WORKDIR/logs"
JOB_ID="$(sbatch --parsable "$BATCH")"
echo "submitted job $JOB_ID; logs in $WORKDIR/logs/ (slurm-$JOB_ID.out and $JOB_ID.<rank>.log per node)"
if [[ $FOLLOW -eq 1 ]]; then
  while squeue -h -j "$JOB_ID" -t PD 2>/dev/null | grep -q .; do sleep 10; done
  tail -n +1 -F "$WORKDIR/logs/$JOB_ID.0.log" &
  TAIL_PID=$!
  while squeue -h -j "$JOB_ID" 2>/dev/null | grep -q .; do sleep 30; done
  kill "$TAIL_PID" 2>/dev/null || true
  sacct -j "$JOB_ID" --format=JobID,State,ExitCode,Elapsed -n || true
fi
