#!/usr/bin/env bash
# mlx-fleet developer entry point: idempotent set-up, then one of
#   demo       bring up a local fleet (etcd, kube-apiserver, operator, two agents, the router), stream a completion
#   test       run the test suite (unit + integration on the real local control plane) in parallel
#              workers; args go to pytest
#   provision  only build/cache the binaries (etcd, kube-apiserver, kubectl, helm, prometheus, promtool)
#   shell      a shell with the virtualenv activated and the cached binaries on PATH
# Everything installed is cached outside the repository, under $MLX_FLEET_CACHE
# (default ~/.cache/mlx-fleet): the virtualenv, the Go-built binaries, generated test models.
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
cmd=${1:-}
case "$cmd" in
  demo|test|provision|shell) shift ;;
  -h|--help|help) usage; exit 0 ;;
  *) usage >&2; [ -n "$cmd" ] && echo "unknown command: $cmd" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${MLX_FLEET_CACHE:-$HOME/.cache/mlx-fleet}
export MLX_FLEET_CACHE=$cache
mkdir -p "$cache"

if [ -t 2 ]; then bold=$'\033[1;34m' red=$'\033[1;31m' off=$'\033[0m'; else bold="" red="" off=""; fi
log() { printf '%s[mlx-fleet]%s %s\n' "$bold" "$off" "$*" >&2; }
die() { printf '%s[mlx-fleet] error:%s %s\n' "$red" "$off" "$*" >&2; exit 1; }

# --- Python: 3.11+ ----------------------------------------------------------------------------
py=""
for cand in python3.13 python3.12 python3.11 python3; do
  if command -v "$cand" >/dev/null 2>&1 &&
     "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    py=$(command -v "$cand"); break
  fi
done
[ -n "$py" ] || die "Python >= 3.11 is required (none found on PATH)"

# --- Go >= 1.21 (it fetches the newer toolchain the builds ask for from the Go module proxy) ---
command -v go >/dev/null 2>&1 ||
  die "Go >= 1.21 is required to build etcd and kube-apiserver (https://go.dev/doc/install; on Debian bookworm: apt-get install -t bookworm-backports golang-go)"
gover=$(go env GOVERSION 2>/dev/null || true)
"$py" - "$gover" <<'PY' || die "Go >= 1.21 is required (found ${gover:-an unknown version}); it fetches newer toolchains by itself"
import re, sys
m = re.match(r"go(\d+)\.(\d+)", sys.argv[1])
sys.exit(0 if m and (int(m[1]), int(m[2])) >= (1, 21) else 1)
PY
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}

# --- Virtualenv, keyed on the interpreter and the dependency list --------------------------------
key=$("$py" -c 'import hashlib, sys; print(hashlib.sha256((sys.version + "\n").encode() + open(sys.argv[1], "rb").read()).hexdigest()[:16])' \
      "$repo/pyproject.toml")
venv="$cache/venv/$key"
stamp="$venv/.mlx-fleet-installed"
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  # Absent, or half-made by an earlier failed attempt: start over.
  rm -rf "$venv"
  log "creating virtualenv $venv"
  "$py" -m venv "$venv" && "$venv/bin/python" -m pip --version >/dev/null 2>&1 ||
    { rm -rf "$venv"; die "could not create a virtualenv with pip (on Debian: apt-get install python3-venv)"; }
fi
if [ ! -f "$stamp" ]; then
  log "installing mlx-fleet and its dependencies from PyPI (first run only)"
  "$venv/bin/python" -m pip install -q --upgrade pip || die "pip could not upgrade itself"
  "$venv/bin/python" -m pip install --progress-bar on -e "$repo[test]" || die "pip install failed"
  echo "$repo" > "$stamp"
  # Virtualenvs of earlier dependency lists are dead weight (~600 MB each).
  for old in "$cache"/venv/*/; do
    [ "${old%/}" = "$venv" ] || rm -rf "$old"
  done
elif [ "$(cat "$stamp")" != "$repo" ]; then
  # Same dependencies, different checkout (e.g. a fresh CI clone): re-point the editable install.
  log "re-pointing the editable install at $repo"
  "$venv/bin/python" -m pip install -q --no-deps -e "$repo" || die "pip install failed"
  echo "$repo" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV=$venv

cd "$repo"
case "$cmd" in
  demo)      python -m mlx_fleet.cli provision && exec python -m mlx_fleet.cli demo "$@" ;;
  test)      # As root on Linux the suite also runs the chart on a real node (tests/test_real_node.py):
             # provision its packages, binaries and images here, with progress, not inside a test.
             node=(); if [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ]; then node=(--node); fi
             python -m mlx_fleet.cli provision ${node[@]+"${node[@]}"} || exit
             # Parallel workers (pytest-xdist, one file per worker, the fault suite first; see
             # docs/development.md, Tests) unless the arguments turn it off (-p no:xdist, -n 0).
             # Two workers per core, at most 4: most integration time is waiting on processes
             # and timers (measured on 2 cores: 299 s with 2 workers, 200 s with 4).
             workers=$(python -c 'import os; print(min(4, 2 * (os.cpu_count() or 1)))')
             parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
             for arg in "$@"; do case $arg in no:xdist|-pno:xdist) parallel=() ;; esac; done
             exec python -m pytest ${parallel[@]+"${parallel[@]}"} "$@" ;;  # (bash 3.2: set -u)
  provision) exec python -m mlx_fleet.cli provision "$@" ;;
  shell)     bins=$(python -m mlx_fleet.cli provision --print-bin-dir) || die "provisioning failed"
             export PATH="$bins:$PATH"; exec "${SHELL:-bash}" ;;
esac
