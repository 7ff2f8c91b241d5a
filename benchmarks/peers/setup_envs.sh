#!/usr/bin/env bash
# Create the peer virtual environments for the peer-comparison benchmark (issue #10).
#
# Usage: bash benchmarks/peers/setup_envs.sh [trl|tunix|all]
#
# Each peer gets its own venv under ${GRPO_JAX_PEERS_CACHE:-~/.cache/grpo_jax/peers}/<name>.
# Idempotent: an env whose marker file (.installed, holding the pip spec) matches the spec
# below is left alone; delete the directory to force a reinstall.
#   trl:   trl + torch==2.13.0 (the CPU build; a looser torch pin pulls the multi-GB CUDA
#          build) + transformers, math-verify.
#   tunix: google-tunix with jax/jaxlib/flax pinned to the versions grpo_jax uses, so the
#          JAX systems are compared on the same XLA.
set -euo pipefail

CACHE="${GRPO_JAX_PEERS_CACHE:-${HOME}/.cache/grpo_jax/peers}"
PYTHON="${PEERS_PYTHON:-python3.11}"
WHICH="${1:-all}"

TRL_SPEC="torch==2.13.0 trl==1.16.0 transformers==5.24.0 accelerate safetensors requests psutil math-verify"
TUNIX_SPEC="google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 psutil math-verify"

make_env() {
  local name="$1" spec="$2" dir="${CACHE}/$1"
  if [[ -f "${dir}/.installed" ]] && [[ "$(cat "${dir}/.installed")" == "${spec}" ]]; then
    echo "[setup_envs] ${name}: up to date (${dir})"
    return 0
  fi
  echo "[setup_envs] ${name}: creating ${dir}"
  mkdir -p "${CACHE}"
  "${PYTHON}" -m venv "${dir}"
  # shellcheck disable=SC2086  # the spec is a word list on purpose
  "${dir}/bin/pip" install --quiet ${spec}
  printf '%s' "${spec}" > "${dir}/.installed"
  "${dir}/bin/pip" freeze > "${dir}/freeze.txt"
  echo "[setup_envs] ${name}: done"
}

case "${WHICH}" in
  trl) make_env trl "${TRL_SPEC}" ;;
  tunix) make_env tunix "${TUNIX_SPEC}" ;;
  all) make_env trl "${TRL_SPEC}"; make_env tunix "${TUNIX_SPEC}" ;;
  *) echo "usage: $0 [trl|tunix|all]" >&2; exit 2 ;;
esac
