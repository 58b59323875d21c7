#!/usr/bin/env bash
# Run the whole test suite against both variants of distributed_core.
#
#   bash ci/test.sh [pure|compiled|all] [--] [pytest args...]      (default: all)
#
# pure      venv .venv-ci/pure: `DISTRIBUTED_CORE_PURE=1 pip install -e ".[test,dask,docs]"`;
#           the suite runs with DISTRIBUTED_CORE_PURE=1 EXPECT_COMPILED=0.
# compiled  venv .venv-ci/compiled: `DISTRIBUTED_CORE_REQUIRE_COMPILED=1 pip install
#           ".[test,dask,docs]"` (not editable); the suite runs from a temporary directory with
#           the venv's own pytest executable and --import-mode=importlib, so nothing in
#           the checkout can shadow the installed extension; EXPECT_COMPILED=1.
#
# Before each run the script checks in that venv that distributed_core.COMPILED is
# False/True and prints which files were loaded. Both variants run even when the
# first fails; the exit status is non-zero if anything failed, including a pytest
# run that collected no tests (exit 5).
#
# Needs only Python 3.10+ (PYTHON=... picks one) and, for the compiled variant, a C
# compiler. The status page's browser test needs Chromium: run as root with apt-get, the
# script installs Debian's `chromium` if it is missing (else that one test skips). Venvs are reused while pyproject.toml and setup.py are unchanged; the
# compiled venv reinstalls the package whenever a source file of it changed.
# DCORE_CI_FRESH=1 rebuilds everything from scratch.
#
# Pytest arguments that name test files or directories (node ids too) may be given
# relative to the current directory or to the checkout.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

VARIANT=all
case "${1:-}" in
  pure | compiled | all) VARIANT=$1; shift ;;
  -h | --help) usage; exit 0 ;;
esac
[ "${1:-}" != -- ] || shift

# Split pytest arguments into test paths (made absolute) and everything else.
TARGETS=()
PYTEST_ARGS=()
prev=""
for arg in "$@"; do
  path=${arg%%::*}
  case "$prev" in
    -k | -m | -p | -o | -c | -W | --deselect | --ignore | --ignore-glob | --rootdir) is_value=1 ;;
    *) is_value=0 ;;
  esac
  if [ "$is_value" = 1 ] || [[ $arg == -* ]]; then
    PYTEST_ARGS+=("$arg")
  elif [ -e "$path" ]; then
    TARGETS+=("$(cd "$(dirname "$path")" && pwd)/$(basename "$path")${arg#"$path"}")
  elif [ -e "$ROOT/$path" ]; then
    TARGETS+=("$ROOT/$arg")
  elif [[ $arg == */* || $arg == *::* || $arg == *.py ]]; then
    die "no such test path: $arg"
  else
    PYTEST_ARGS+=("$arg")
  fi
  prev=$arg
done
[ "${#TARGETS[@]}" -gt 0 ] || TARGETS=("$ROOT/tests")
if [ "$VARIANT" = all ]; then VARIANTS=(pure compiled); else VARIANTS=("$VARIANT"); fi

find_python
TMP=$(mktemp -d "${TMPDIR:-/tmp}/dcore-ci.XXXXXX")
T_START=$(now)
declare -A RESULT=() STATUS=()
SUMMARY_DONE=0

summary() {
  local name
  [ "$SUMMARY_DONE" = 0 ] || return 0
  SUMMARY_DONE=1
  printf '\n========================= ci/test.sh summary =========================\n'
  "$BASE_PYTHON" -c 'import sys; print("Python", sys.version.split()[0], "at", sys.executable)'
  for name in "${VARIANTS[@]}"; do
    printf '%-9s %-38s %s\n' "$name" "${STATUS[$name]:-NOT RUN}" "${RESULT[$name]:-}"
  done
  print_timings
  printf '%-46s %7ss\n' "total" "$(elapsed "$T_START")"
}
on_exit() {
  local rc=$?
  if [ "$SUMMARY_DONE" = 0 ]; then
    [ "$rc" = 0 ] || for name in "${VARIANTS[@]}"; do
      [ -n "${STATUS[$name]:-}" ] || STATUS[$name]="NOT RUN (setup failed, exit $rc)"
    done
    summary
  fi
  rm -rf "$TMP"
}
trap on_exit EXIT

# --- install ---------------------------------------------------------------------

setup_pure() {
  local venv=$CI_DIR/pure stamp t0
  t0=$(now)
  stamp=$(hash_inputs "$ROOT/pyproject.toml" "$ROOT/setup.py")
  if venv_is_current "$venv" "$stamp"; then
    log "pure: reusing $venv (editable install; pyproject.toml and setup.py unchanged)"
  else
    log "pure: creating $venv: DISTRIBUTED_CORE_PURE=1 pip install -e \".[test,dask,docs]\""
    fresh_venv "$venv"
    (cd "$ROOT" && env -u DISTRIBUTED_CORE_REQUIRE_COMPILED DISTRIBUTED_CORE_PURE=1 \
      "$(venv_python "$venv")" -m pip install "${PIP_QUIET[@]}" -e ".[test,dask,docs]")
    write_stamp "$venv" "$stamp"
  fi
  record "pure: venv + editable install" "$t0"
}

setup_compiled() {
  local venv=$CI_DIR/compiled env_stamp src_stamp t0
  t0=$(now)
  env_stamp=$(hash_inputs "$ROOT/pyproject.toml" "$ROOT/setup.py")
  src_stamp=$(hash_inputs "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/MANIFEST.in" \
    "$ROOT/distributed_core" "$ROOT/distributed_server")
  # setuptools' build/ keeps files of earlier builds, which can end up in the wheel.
  if venv_is_current "$venv" "$env_stamp"; then
    if [ "$(cat "$venv/.ci-src-stamp" 2>/dev/null)" = "$src_stamp" ]; then
      log "compiled: reusing $venv (installed package is built from the current sources)"
    else
      log "compiled: sources changed; rebuilding and reinstalling the package into $venv"
      rm -f "$venv/.ci-src-stamp"
      rm -rf "$ROOT/build"
      (cd "$ROOT" && env -u DISTRIBUTED_CORE_PURE DISTRIBUTED_CORE_REQUIRE_COMPILED=1 \
        "$(venv_python "$venv")" -m pip install "${PIP_QUIET[@]}" --no-deps --force-reinstall .)
    fi
  else
    log "compiled: creating $venv: DISTRIBUTED_CORE_REQUIRE_COMPILED=1 pip install \".[test,dask,docs]\""
    fresh_venv "$venv"
    rm -rf "$ROOT/build"
    (cd "$ROOT" && env -u DISTRIBUTED_CORE_PURE DISTRIBUTED_CORE_REQUIRE_COMPILED=1 \
      "$(venv_python "$venv")" -m pip install "${PIP_QUIET[@]}" ".[test,dask,docs]")
    write_stamp "$venv" "$env_stamp"
  fi
  printf '%s' "$src_stamp" >"$venv/.ci-src-stamp"
  record "compiled: venv + build + install" "$t0"
}

# --- check and run ------------------------------------------------------------------

# variant_env NAME: the environment a variant's checks and tests run with.
variant_env() {
  case "$1" in
    pure) printf '%s\n' -u DISTRIBUTED_CORE_REQUIRE_COMPILED DISTRIBUTED_CORE_PURE=1 EXPECT_COMPILED=0 ;;
    compiled) printf '%s\n' -u DISTRIBUTED_CORE_PURE EXPECT_COMPILED=1 ;;
  esac
}

# check_variant NAME: in NAME's venv, from outside the checkout, COMPILED must be what
# the variant promises and the package must come from where the variant says.
check_variant() {
  local name=$1 venv=$CI_DIR/$1 env_args
  mapfile -t env_args < <(variant_env "$name")
  log "$name: which distributed_core does this venv import?"
  (cd "$TMP" && env "${env_args[@]}" "$(venv_python "$venv")" - "$name" "$ROOT" <<'PY'
import os
import sys

import distributed_core

variant, root = sys.argv[1], os.path.realpath(sys.argv[2])
compiled = distributed_core.COMPILED
package = os.path.realpath(distributed_core.__file__)
core = distributed_core._core.__file__
worker_core = distributed_core._worker_core.__file__
print(f"  distributed_core.COMPILED = {compiled}")
print(f"  package loaded from       {package}")
print(f"  core loaded from          {core}")
print(f"  worker core loaded from   {worker_core}")
in_checkout = os.path.dirname(package) == os.path.join(root, "distributed_core")
if variant == "compiled":
    if compiled is not True:
        sys.exit(f"compiled variant: distributed_core.COMPILED is {compiled!r}, expected True")
    if in_checkout:
        sys.exit("compiled variant: distributed_core was imported from the checkout, "
                 "not from the installed package")
else:
    if compiled is not False:
        sys.exit(f"pure variant: distributed_core.COMPILED is {compiled!r}, expected False")
    if not in_checkout:
        sys.exit(f"pure variant: the editable install does not point at {root}/distributed_core")
PY
  )
}

# run_suite NAME: the whole suite in NAME's venv, from a directory outside the checkout.
run_suite() {
  local name=$1 venv=$CI_DIR/$1 env_args rundir=$TMP/run-$1 logfile=$TMP/$1.log rc t0
  mapfile -t env_args < <(variant_env "$name")
  mkdir -p "$rundir"
  log "$name: pytest with ${env_args[*]:2}, from $rundir"
  t0=$(now)
  set +e
  (cd "$rundir" && env "${env_args[@]}" "$(venv_exe "$venv" pytest)" \
    --import-mode=importlib -p no:cacheprovider \
    --rootdir "$ROOT" -c "$ROOT/pyproject.toml" \
    "${TARGETS[@]}" ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}) 2>&1 | tee "$logfile"
  rc=${PIPESTATUS[0]}
  set -e
  record "$name: pytest" "$t0" "$rc"
  RESULT[$name]=$(grep -E '(passed|failed|errors?|skipped|deselected|xfailed|xpassed|no tests ran).* in [0-9.]+s' "$logfile" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//' || true)
  case "$rc" in
    0) STATUS[$name]="PASSED" ;;
    1) STATUS[$name]="FAILED (tests failed)" ;;
    2) STATUS[$name]="FAILED (interrupted, exit 2)" ;;
    3) STATUS[$name]="FAILED (pytest internal error, exit 3)" ;;
    4) STATUS[$name]="FAILED (pytest usage error, exit 4)" ;;
    5) STATUS[$name]="FAILED (no tests collected, exit 5)" ;;
    *) STATUS[$name]="FAILED (exit $rc)" ;;
  esac
  return 0
}

variant() {
  local name=$1 t0
  "setup_$name"
  t0=$(now)
  if check_variant "$name"; then
    record "$name: COMPILED check" "$t0"
    run_suite "$name"
  else
    record "$name: COMPILED check" "$t0" 1
    STATUS[$name]="FAILED (COMPILED / import-location check)"
  fi
}

log "distributed-core tests: ${VARIANTS[*]}; checkout $ROOT; venvs in $CI_DIR"
t_browser=$(now)
ensure_browser
record "browser for the status page test" "$t_browser"
for name in "${VARIANTS[@]}"; do
  variant "$name"
done

summary
for name in "${VARIANTS[@]}"; do
  [ "${STATUS[$name]:-}" = PASSED ] || exit 1
done
exit 0
