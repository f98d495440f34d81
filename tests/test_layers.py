"""The package's shape (docs/README.md "The code"): no import cycle, every
import goes from a higher layer to a lower one, no module much above 400
lines, and the tools (bench, tune, cluster) take from the package only its
public names or a module of the declared internal interface (INTERNAL),
reaching into no private attribute.  Read from the source alone (ast), so
nothing is imported."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "equarx_mpi"
#: the layers, lowest first; a module may import its own layer's modules
#: and any lower layer's, never a higher one's
LAYERS = [("names",), ("kernels",), ("bounds",), ("wire",), ("collectives",), ("model",),
          ("call",), ("comm", "running", "feedback", "helper", "wrapping", "warmup", "threads",
                      "__init__"),
          ("torch",),
          ("bench", "tune", "cluster")]
MAX_LINES = 420
#: the tools: they may use one another freely
TOOLS = ("bench", "tune", "cluster")
#: the public face: the names in these packages' __all__
PUBLIC = ("equarx_mpi", "equarx_mpi.torch")
#: the modules below the public face a tool may import, and why
INTERNAL = {
    "equarx_mpi.names": "the shared vocabulary: dtypes, kernel op and rounding codes, Layout",
    "equarx_mpi.threads": "bench app counts cores and threads per rank as the library does",
    "equarx_mpi.kernels": "bench kernels times the kernels alone",
    "equarx_mpi.kernels.rotate": "bench quality rotates before it quantizes; bench kernels "
                                 "--rotate times it",
    "equarx_mpi.kernels.shm": "bench shm times the shared window's kernels alone",
    "equarx_mpi.wire.formats": "bench kernels and tune time each wire format's operations",
    "equarx_mpi.wire.threaded": "bench kernels times a format split over threads",
    "equarx_mpi.wire.mixed": "bench tolerance --ablate switches its prediction",
    "equarx_mpi.collectives.shm": "bench shm runs the shared window alone",
    "equarx_mpi.collectives.engine": "tune measure compiles a format's kernels first (warm)",
    "equarx_mpi.collectives.nodes": "tune measure splits the ranks into (faked) nodes",
    "equarx_mpi.call.options": "tune reads the options' values and defaults",
    "equarx_mpi.call.policy": "tune predict chooses as the library would",
    "equarx_mpi.model.profiles": "tune writes and reads the profiles the library decides with",
    "equarx_mpi.model.costmodel": "tune predict models clusters nobody measured",
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        yield ".".join(("equarx_mpi",) + rel.parts).removesuffix(".__init__"), path


def _package(name, path):
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _from(node, pkg):
    """The module a ``from ... import`` names, relative imports resolved."""
    base = node.module or ""
    if node.level:
        base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                        + ([base] if base else []))
    return base


def _imports(name, path, mods):
    """The package's modules that ``name`` imports, anywhere in its body
    (``from package import module`` imports the module, not the package)."""
    pkg = _package(name, path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("equarx_mpi")}
        elif isinstance(node, ast.ImportFrom):
            base = _from(node, pkg)
            if base.startswith("equarx_mpi"):
                subs = {f"{base}.{a.name}" for a in node.names} & set(mods)
                found |= subs or {base}
    return found


def _graph():
    mods = dict(_modules())
    return mods, {m: {i for i in _imports(m, p, mods) if i in mods and i != m}
                  for m, p in mods.items()}


def _layer(mod):
    part = (mod.split(".") + ["__init__"])[1]
    for k, names in enumerate(LAYERS):
        if part in names:
            return k
    raise AssertionError(f"{mod}: in no layer of tests/test_layers.py")


def test_no_import_cycle():
    _, graph = _graph()
    state = {}

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2
    for m in graph:
        if m not in state:
            visit(m, [m])


def test_imports_go_down_the_layers():
    _, graph = _graph()
    up = [f"{m} -> {n}" for m, deps in graph.items() for n in deps
          if m != "equarx_mpi" and _layer(n) > _layer(m)]
    assert not up, "imports from a lower layer to a higher one: " + ", ".join(sorted(up))


def test_the_leaf_imports_nothing_of_the_package():
    _, graph = _graph()
    assert graph["equarx_mpi.names"] == set()


def test_no_module_much_above_400_lines():
    mods, _ = _graph()
    long = {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def _all(pkg):
    """The names in package ``pkg``'s __all__ (read, not imported)."""
    init = PKG.joinpath(*pkg.split(".")[1:], "__init__.py")
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
                "__all__"]:
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{pkg}: no __all__")


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _tool_faults(name, path, mods):
    """What tool module ``name`` takes from the package outside the tools
    that is neither public nor INTERNAL, and the private attributes it
    reads of anything but itself (self, cls)."""
    public = {pkg: _all(pkg) for pkg in PUBLIC}
    pkg = _package(name, path)
    used, aliases, faults = [], {}, []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("equarx_mpi"):
                    used.append((a.name, None))
                    # "import a.b" binds a, "import a.b as c" binds c to a.b
                    aliases[a.asname or "equarx_mpi"] = a.name if a.asname else "equarx_mpi"
        elif isinstance(node, ast.ImportFrom):
            base = _from(node, pkg)
            if base.startswith("equarx_mpi"):
                used += [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in mods
                         else (base, a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            faults.append(f"reads private attribute .{node.attr}")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            faults.append(f"reads private attribute {node.args[1].value}")
    for node in ast.walk(tree):
        # a public package imported whole: its public names, or a module
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and aliases.get(node.value.id) in PUBLIC):
            mod = aliases[node.value.id]
            sub = f"{mod}.{node.attr}"
            used.append((sub, None) if sub in mods else (mod, node.attr))
    for mod, attr in used:
        if _layer(mod) == len(LAYERS) - 1:
            continue
        if attr is not None and _private(attr):
            faults.append(f"imports private {mod}.{attr}")
        elif mod in PUBLIC:
            if attr is not None and attr not in public[mod]:
                faults.append(f"uses {mod}.{attr}, not in its __all__")
        elif mod not in INTERNAL:
            faults.append(f"imports {mod}, neither public nor INTERNAL")
    return faults


def test_tools_use_the_public_face_or_the_internal_interface():
    mods, _ = _graph()
    faults = [f"{m}: {f}" for m, p in mods.items() if _layer(m) == len(LAYERS) - 1
              for f in _tool_faults(m, p, mods)]
    assert not faults, "\n".join(sorted(set(faults)))


def test_the_internal_interface_lists_what_tools_use():
    mods, graph = _graph()
    used = {n for m, deps in graph.items() if _layer(m) == len(LAYERS) - 1 for n in deps}
    stale = sorted(set(INTERNAL) - (set(mods) & used))
    assert not stale, f"INTERNAL lists modules no tool imports (or that do not exist): {stale}"
