"""An MPI job started by a serial test: this venv's mpirun, allowed to run
as root and oversubscribe, in a session of its own that is killed whole if
it outlives its timeout (so a hung rank cannot linger)."""
import os
import signal
import subprocess
import sys

import pytest

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")


def run_job(cmd, timeout, env=ENV, stderr=subprocess.PIPE):
    """(returncode, stdout, stderr) of ``cmd``; the test fails if it runs
    past ``timeout`` seconds.  stderr=subprocess.STDOUT merges the two."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"hung: no exit within {timeout}s\n{out[-3000:]}\n{(err or '')[-3000:]}")
    return p.returncode, out, err
