"""Profiles for the cost model (costmodel.py): where they are, loading,
merging, the built-in one, and the one all ranks of a communicator use.
``python -m equarx_mpi.tune`` measures and saves them (docs/TUNING.md)."""
import copy as _copy
import hashlib
import json
import os
import platform
import re
import socket
import warnings

VERSION = 1
ENV = "EQUARX_MPI_PROFILE"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_key(hostname=None):
    """What names a machine, or a cluster of like nodes, for its profile:
    the CPU model, the cores per node and the host name without its digits
    (node017 and node102 share a profile).  12 hex digits."""
    name = re.sub(r"\d+", "", (hostname or socket.gethostname()).split(".")[0])
    text = f"{cpu_model()}|{os.cpu_count()}|{name}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_path(key=None):
    """Where tune saves, and QuantizedComm looks for, this machine's profile:
    $XDG_CACHE_HOME (or ~/.cache)/equarx_mpi/profile-<host_key>.json."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "equarx_mpi", f"profile-{key or host_key()}.json")


#: the built-in profile, written by ``python -m equarx_mpi.tune builtin``
BUILTIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin.json")


def builtin():
    """The profile measured on the project's own machine (docs/TUNING.md);
    its "generated" entry (the command and the measured profiles' machines)
    is left out."""
    global _BUILTIN
    if _BUILTIN is None:
        with open(BUILTIN) as f:
            _BUILTIN = json.load(f)
        _BUILTIN.pop("generated", None)
    return _copy.deepcopy(_BUILTIN)


_BUILTIN = None


def check(p):
    """Raise ValueError unless ``p`` looks like a profile of this version."""
    if not isinstance(p, dict) or p.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} equarx_mpi profile")
    for name in ("cores", "copy", "kernels", "layouts"):
        if name not in p:
            raise ValueError(f"profile lacks {name!r}")
    # optional (tune measures it since issue 22): {wire: {"T": {kernel:
    # speedup at T threads}}}; profiles without it use costmodel's assumption
    for wire, per in (p.get("threads") or {}).items():
        for T, ks in per.items():
            if not (str(T).isdigit() and int(T) >= 2 and isinstance(ks, dict) and all(
                    isinstance(v, (int, float)) and v > 0 for v in ks.values())):
                raise ValueError(f"profile threads[{wire!r}][{T!r}]: expected thread counts "
                                 f">= 2 and positive speedups")
    for name, lay in p["layouts"].items():
        n = len(lay.get("sizes", []))
        if any(len(t) != n for t in lay.get("times", {}).values()):
            raise ValueError(f"profile layout {name}: times and sizes differ in length")
    return p


def load(path):
    with open(path) as f:
        return check(json.load(f))


def merge(base, top):
    """``top`` over ``base``: top's layouts, kernels and scalars win, what
    only base has stays (a one-node profile borrows the built-in network)."""
    out = _copy.deepcopy(base)
    for k, v in top.items():
        if k == "layouts":
            out["layouts"].update(_copy.deepcopy(v))
        elif k in ("kernels", "threads"):
            for wire, per in v.items():
                out.setdefault(k, {}).setdefault(wire, {}).update(_copy.deepcopy(per))
        else:
            out[k] = _copy.deepcopy(v)
    return out


def find_profile():
    """(profile, where it came from): $EQUARX_MPI_PROFILE (a path, or
    "builtin"), else this machine's saved profile if there is one, else the
    built-in one; always over the built-in, which fills what it lacks.  A
    bad file named by the variable raises ValueError; a bad saved one warns."""
    path = os.environ.get(ENV, "").strip()
    if path == "builtin":
        return builtin(), "builtin"
    if path:
        try:
            return merge(builtin(), load(path)), path
        except (OSError, ValueError) as e:
            raise ValueError(f"{ENV}={path!r}: {e}") from None
    path = default_path()
    if os.path.exists(path):
        try:
            return merge(builtin(), load(path)), path
        except (OSError, ValueError) as e:
            warnings.warn(f"equarx_mpi: ignoring the profile {path}: {e}", stacklevel=2)
    return builtin(), "builtin"




def agreed(comm):
    """(profile, where it came from): rank 0 finds it and sends it to all
    (collective), so that every rank decides alike; a bad
    $EQUARX_MPI_PROFILE raises the same ValueError everywhere."""
    found = err = None
    if comm.Get_rank() == 0:
        try:
            found = find_profile()
        except ValueError as e:
            err = str(e)
    found, err = comm.bcast((found, err))
    if err is not None:
        raise ValueError(f"equarx_mpi: {err}")
    return found
