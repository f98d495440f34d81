"""The documents tell the truth, checked from the documents themselves.

    python -m pytest -q tests/test_docs.py        # serial, no mpirun

- every ``python -m equarx_mpi...`` command written in a code span or code
  block of README.md, docs/*.md or examples/README.md (with its subcommand:
  ``bench shm``, ``tune predict``, ``cluster run``) answers ``--help`` with
  exit status 0: the spellings are collected from the docs, so a renamed
  command fails here until the docs follow;
- the README's Python blocks marked ``<!-- test_docs: run -->`` run at one
  rank (every ```python block of the README carries a marker: ``run``, or
  ``skip: why``), with the library's defaults;
- every relative link of those documents points to an existing file, and an
  anchor into a Markdown file to one of its headings (GitHub's spelling);
- every document under docs/ and examples/README.md is reachable by links
  from README.md;
- README.md is at most 200 lines.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
MAX_README_LINES = 200
TIMEOUT = 300           # seconds per subprocess; a cold numba cache may compile

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
COMMAND = re.compile(r"python\s+-m\s+(equarx_mpi(?:\.[A-Za-z_]\w*)*)"
                     r"(?:[ \t]+\[?([a-z][a-z_]*)\]?)?")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MARKER = re.compile(r"<!--\s*test_docs:\s*(run|skip:[^>]*?)\s*-->\s*\n```python\n(.*?)^```",
                    re.S | re.M)


def _text(path):
    return path.read_text(encoding="utf-8")


def _code(text):
    """The code blocks and inline code spans of a Markdown text."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    spans = [s for s in INLINE.findall(prose) if "\n\n" not in s]
    return blocks + spans


def documented_commands():
    """{(module, subcommand or ''): first document that writes it}."""
    found = {}
    for path in DOCS:
        for code in _code(_text(path)):
            for m in COMMAND.finditer(code):
                found.setdefault((m.group(1), m.group(2) or ""), path.relative_to(ROOT))
    return found


COMMANDS = documented_commands()


def _env():
    env = dict(os.environ)
    env.pop("EQUARX_MPI_ALGORITHM", None)   # conftest's suite default: the docs mean the library's
    env.setdefault("EQUARX_MPI_PROFILE", "builtin")
    return env


def test_the_docs_document_commands():
    modules = {m for m, _ in COMMANDS}
    for expected in ("equarx_mpi.bench", "equarx_mpi.tune", "equarx_mpi.warmup",
                     "equarx_mpi.cluster"):
        assert expected in modules, f"no document shows `python -m {expected}`"


@pytest.mark.parametrize("module,sub", sorted(COMMANDS),
                         ids=[" ".join(filter(None, k)) for k in sorted(COMMANDS)])
def test_documented_command_answers_help(module, sub):
    argv = [sys.executable, "-m", module] + ([sub] if sub else []) + ["--help"]
    r = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT)
    shown = " ".join(argv[1:])
    assert r.returncode == 0, (f"`python {shown}` (as {COMMANDS[module, sub]} writes it) "
                               f"exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    assert "usage" in (r.stdout + r.stderr).lower(), f"`python {shown}` printed no usage"


def _readme_blocks():
    text = _text(README)
    marked = MARKER.findall(text)
    return text, marked


def test_every_readme_python_block_is_marked():
    text, marked = _readme_blocks()
    blocks = re.findall(r"^```python\n", text, re.M)
    assert len(marked) == len(blocks), (
        f"README.md has {len(blocks)} ```python blocks and {len(marked)} markers: put "
        f"<!-- test_docs: run --> (or <!-- test_docs: skip: why -->) right before each")
    assert any(kind == "run" for kind, _ in marked), "no README block is marked to run"


RUN_BLOCKS = [code for kind, code in _readme_blocks()[1] if kind == "run"]


@pytest.mark.parametrize("code", RUN_BLOCKS, ids=[f"block{i}" for i in range(len(RUN_BLOCKS))])
def test_readme_snippet_runs_at_one_rank(code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"README snippet failed:\n{code}\n{r.stdout[-2000:]}{r.stderr[-3000:]}"


def _slug(heading):
    """GitHub's anchor for a heading."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def _anchors(path):
    seen, out = {}, set()
    for line in FENCE.sub("", _text(path)).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def _links(path):
    """(target path or None for this file, anchor or '') of every relative link."""
    for target in LINK.findall(FENCE.sub("", _text(path))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):       # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        yield (path.parent / file).resolve() if file else path, anchor


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(doc):
    bad = []
    for target, anchor in _links(doc):
        if not target.exists():
            bad.append(f"{target.relative_to(ROOT) if ROOT in target.parents else target}: "
                       f"no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{target.relative_to(ROOT)}#{anchor}: no such heading")
    assert not bad, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(bad)


def test_every_document_is_reachable_from_the_readme():
    seen, todo = {README}, [README]
    while todo:
        for target, _ in _links(todo.pop()):
            if target.suffix == ".md" and target.exists() and target not in seen:
                seen.add(target)
                todo.append(target)
    missing = [str(d.relative_to(ROOT)) for d in DOCS if d not in seen]
    assert not missing, f"not reachable by links from README.md: {missing}"


def test_readme_is_short():
    n = len(_text(README).splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


def test_every_option_is_explained_in_options_md():
    """docs/OPTIONS.md is the one place options are explained: each option
    of the code (and its environment variable) is there, and nothing it
    names as an option is unknown to the code."""
    from equarx_mpi.call import options
    text = (ROOT / "docs" / "OPTIONS.md").read_text()
    for name in options.DEFAULTS:
        assert f"`{name}" in text, f"option {name!r} is not explained in docs/OPTIONS.md"
        assert f"EQUARX_MPI_{name.upper()}" in text, f"EQUARX_MPI_{name.upper()} is not there"
    named = set(re.findall(r"EQUARX_MPI_([A-Z_]+)", text))
    known = {n.upper() for n in options.DEFAULTS} | {"DISABLE", "LOG", "PROFILE", "THREAD_WARNING",
                                                      "ABORT_ON_EXCEPTION", "FAKE_NODES"}
    assert named <= known | {"FULL", "LARGE", "PROPERTY_CASES", "HYPOTHESIS_CASES"}, named - known
