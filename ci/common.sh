# shellcheck shell=bash
# Helpers shared by ci/test.sh and ci/build_wheel.sh. Source it; do not run it.
#
# Everything these scripts install goes into virtualenvs under .venv-ci/ in the
# checkout (override with DCORE_CI_DIR). A venv is reused while its stamp (the Python
# version plus a hash of the files that decide what gets installed) still matches;
# DCORE_CI_FRESH=1 throws every venv away first.
#
# Interpreter: $PYTHON if set, else python3, else python; it must be 3.10 or newer.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC2034  # used by the scripts that source this file
CI_DIR=${DCORE_CI_DIR:-$ROOT/.venv-ci}
PIP_QUIET=(--quiet --progress-bar off)

log() { printf '\n==> %s\n' "$*"; }
warn() { printf 'WARNING: %s\n' "$*" >&2; }
die() { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

# now: seconds since the epoch, with a fraction where bash has EPOCHREALTIME.
now() { printf '%s' "${EPOCHREALTIME:-$SECONDS}"; }
# elapsed START: seconds since START, one decimal.
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

TIMINGS=()
# record LABEL T0 [RC]: remember that LABEL took from T0 until now (and ended with RC).
# (Not a wrapper around the command on purpose: bash ignores `set -e` inside any
# function that is called as part of a `cmd || ...` list.)
record() {
  local rc=${3:-0}
  TIMINGS+=("$(printf '%-46s %7ss%s' "$1" "$(elapsed "$2")" \
    "$([ "$rc" = 0 ] || printf '  (exit %s)' "$rc")")")
}
print_timings() {
  local line
  printf 'Timings:\n'
  for line in "${TIMINGS[@]}"; do printf '  %s\n' "$line"; done
}

find_python() {
  local candidate version_ok='import sys; sys.exit(sys.version_info < (3, 10))'
  if [ -n "${PYTHON:-}" ]; then
    BASE_PYTHON=$(command -v "$PYTHON") || die "PYTHON=$PYTHON: no such command"
    "$BASE_PYTHON" -c "$version_ok" 2>/dev/null ||
      die "PYTHON=$PYTHON does not run as Python 3.10+ ($("$BASE_PYTHON" -V 2>&1 | head -n 1))"
    return
  fi
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$version_ok" 2>/dev/null; then
      BASE_PYTHON=$(command -v "$candidate")
      return
    fi
  done
  die "no Python 3.10+ found as python3 or python (set PYTHON=/path/to/python3.X)"
}

# venv_python DIR: the interpreter of the venv at DIR (POSIX or Windows layout).
venv_python() {
  if [ -x "$1/bin/python" ]; then printf '%s' "$1/bin/python"; else printf '%s' "$1/Scripts/python.exe"; fi
}
venv_exe() {  # venv_exe DIR NAME: a console script of the venv at DIR
  if [ -d "$1/bin" ]; then printf '%s' "$1/bin/$2"; else printf '%s' "$1/Scripts/$2.exe"; fi
}

# hash_inputs PATH...: one sha256 over the interpreter's version and the given files
# (directories: their source files, recursively). Missing paths count as missing.
hash_inputs() {
  "$BASE_PYTHON" - "$@" <<'PY'
import hashlib, pathlib, sys
SOURCE = {".py", ".pyx", ".pxd", ".pxi", ".toml", ".cfg", ".in", ".txt", ".md",
          ".html", ".js", ".css", ".svg"}  # the status page ships in the package too
h = hashlib.sha256(sys.version.encode() + sys.executable.encode())
for arg in sys.argv[1:]:
    p = pathlib.Path(arg)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*")
                       if f.is_file() and f.suffix in SOURCE and "__pycache__" not in f.parts)
    else:
        files = [p]
    for f in files:
        h.update(str(f).encode() + b"\0")
        h.update(f.read_bytes() if f.is_file() else b"<missing>")
        h.update(b"\0")
print(h.hexdigest())
PY
}

# fresh_venv DIR: a new venv at DIR with an up-to-date pip (whatever was there is removed).
fresh_venv() {
  rm -rf "$1"
  mkdir -p "$(dirname "$1")"
  "$BASE_PYTHON" -m venv "$1"
  "$(venv_python "$1")" -m pip install "${PIP_QUIET[@]}" --upgrade pip
}

# venv_is_current DIR STAMP: true when DIR is a working venv whose install finished
# with this stamp (stamps are written only after a successful install).
venv_is_current() {
  [ "${DCORE_CI_FRESH:-0}" != 1 ] && [ -f "$1/.ci-stamp" ] &&
    [ "$(cat "$1/.ci-stamp")" = "$2" ] && "$(venv_python "$1")" -c '' 2>/dev/null
}
write_stamp() { printf '%s' "$2" >"$1/.ci-stamp"; }

# ensure_browser: the status page's browser test needs Chromium. Install Debian's
# `chromium` when it is missing and we can (root with apt-get); then export
# DCORE_REQUIRE_BROWSER=1 so that the test fails instead of skipping if the browser is
# still not found. Without root or apt-get the test skips and says why.
ensure_browser() {
  local name
  for name in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$name" >/dev/null 2>&1; then
      export DCORE_REQUIRE_BROWSER=1
      return 0
    fi
  done
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian's chromium for the status page's browser test"
    if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        chromium) >/dev/null 2>&1 && command -v chromium >/dev/null; then
      export DCORE_REQUIRE_BROWSER=1
      return 0
    fi
    warn "apt-get install chromium failed: the browser test will be skipped"
  else
    warn "no Chromium, and no root with apt-get to install it: the browser test will be skipped"
  fi
}
