"""``python -m equarx_mpi.tune builtin A.json B.json ...``, for maintainers:
the built-in profile (equarx_mpi/model/builtin.json, what algorithm="auto"
decides with on a machine that has none) from measured ones, later ones
winning.  Serial; no MPI job."""
import argparse
import json
import re

from equarx_mpi.model import profiles


def source(paths):
    """The built-in profile's JSON text merged from ``paths``; its
    "generated" entry names the command and each profile's machine."""
    merged = profiles.load(paths[0])
    for path in paths[1:]:
        merged = profiles.merge(merged, profiles.load(path))
    merged.update(source="builtin", key="builtin")
    merged.pop("machine", None)
    # thread speedups measured on the emulated cluster's 2 shared cores say
    # little of another machine's: the built-in keeps the model's Amdahl
    # assumption (costmodel.ASSUMED_PARALLEL)
    merged.pop("threads", None)
    machines = [profiles.load(path).get("machine", {}) for path in paths]
    merged["generated"] = {
        "command": "python -m equarx_mpi.tune builtin " + " ".join(paths),
        "from": [f"{m.get('command', '?')}  ({m.get('ranks', '?')} ranks, {m.get('cpu', '?')}, "
                 f"{m.get('date', '?')}, load {m.get('load_before', '?')})" for m in machines]}
    return _one_line_lists(json.dumps(merged, indent=1)) + "\n"


def _one_line_lists(text):
    """json's indented text with each list of numbers (or nulls) on one line."""
    return re.sub(r"\[\s*([-+0-9.eE, \nnul]*?)\s*\]",
                  lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m equarx_mpi.tune builtin",
                                description="Merge measured profiles (later ones win) into "
                                "the built-in one, equarx_mpi/model/builtin.json.  Serial.")
    p.add_argument("profiles", nargs="+", metavar="PROFILE.json")
    p.add_argument("--output", default=profiles.BUILTIN, metavar="PATH",
                   help="where to write (default: the package's model/builtin.json)")
    a = p.parse_args(argv)
    text = source(a.profiles)
    with open(a.output, "w") as f:
        f.write(text)
    print(f"wrote {a.output}")
    return 0
