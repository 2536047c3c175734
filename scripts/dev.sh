#!/usr/bin/env bash
# mlx-fleet developer entry point: idempotent set-up, then one of
#   demo       bring up a local fleet (etcd, kube-apiserver, operator, two agents), stream a completion
#   test       run the test suite (unit + integration on the real local control plane)
#   provision  only build/cache the control-plane binaries (etcd, kube-apiserver, kubectl)
#   shell      a shell with the virtualenv activated and the cached binaries on PATH
# Everything installed is cached outside the repository, under $MLX_FLEET_CACHE
# (default ~/.cache/mlx-fleet): the virtualenv, the Go-built binaries, generated test models.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${MLX_FLEET_CACHE:-$HOME/.cache/mlx-fleet}
export MLX_FLEET_CACHE=$cache
mkdir -p "$cache"

log() { printf '\033[1;34m[mlx-fleet]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31m[mlx-fleet] error:\033[0m %s\n' "$*" >&2; exit 1; }

# --- Python: 3.11+ ----------------------------------------------------------------------------
py=""
for cand in python3.13 python3.12 python3.11 python3; do
  if command -v "$cand" >/dev/null 2>&1 &&
     "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    py=$(command -v "$cand"); break
  fi
done
[ -n "$py" ] || die "Python >= 3.11 is required (none found on PATH)"

# --- Virtualenv, keyed on the interpreter and the dependency list --------------------------------
key=$( { "$py" -c 'import sys; print(sys.version)'; cat "$repo/pyproject.toml"; } | sha256sum | cut -c1-16)
venv="$cache/venv/$key"
stamp="$venv/.mlx-fleet-installed"
if [ ! -x "$venv/bin/python" ]; then
  log "creating virtualenv $venv"
  "$py" -m venv "$venv" || die "could not create a virtualenv (on Debian: apt-get install python3-venv)"
fi
if [ ! -f "$stamp" ]; then
  log "installing mlx-fleet and its dependencies from PyPI (first run only)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install --progress-bar on -e "$repo[test]" || die "pip install failed"
  echo "$repo" > "$stamp"
elif [ "$(cat "$stamp")" != "$repo" ]; then
  # Same dependencies, different checkout (e.g. a fresh CI clone): re-point the editable install.
  log "re-pointing the editable install at $repo"
  "$venv/bin/python" -m pip install -q --no-deps -e "$repo" || die "pip install failed"
  echo "$repo" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV=$venv

# --- Go toolchain for building etcd / kube-apiserver / kubectl ----------------------------------
# Go >= 1.21 fetches a newer toolchain itself from the Go module proxy when a module needs one.
if ! command -v go >/dev/null 2>&1; then
  log "installing Go from Debian's packages"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq golang-go; } >/dev/null ||
    die "Go is required to build the control-plane binaries; install Go >= 1.21"
fi
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}

cmd=${1:-help}; shift || true
cd "$repo"
case "$cmd" in
  demo)      python -m mlx_fleet.cli provision && exec python -m mlx_fleet.cli demo "$@" ;;
  test)      python -m mlx_fleet.cli provision && exec python -m pytest "$@" ;;
  provision) exec python -m mlx_fleet.cli provision "$@" ;;
  shell)     export PATH="$(python -m mlx_fleet.cli provision --print-bin-dir):$PATH"; exec "${SHELL:-bash}" ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
