"""The package's shape (docs/README.md "The code"): no import cycle, every
import goes from a higher layer to a lower one, no module much above 400
lines.  Read from the source alone (ast), so nothing is imported."""
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


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        yield ".".join(("equarx_mpi",) + rel.parts).removesuffix(".__init__"), path


def _imports(name, path, mods):
    """The package's modules that ``name`` imports, anywhere in its body
    (``from package import module`` imports the module, not the package)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("equarx_mpi")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                                + ([base] if base else []))
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
