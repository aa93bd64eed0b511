"""The layout stays as issue 47 left it (docs/ARCHITECTURE.md, "The tree"): duet's version of vLLM's
``check-forbidden-imports`` and ``validate-config`` hooks.

- no import cycle among the product's modules, counting every import: module level and inside functions
  (a function-level import hides a cycle, it does not break it); only ``if TYPE_CHECKING:`` imports are left out,
  since they never run;
- every module and subpackage named in its package's docstring (the "Pieces" list);
- the torch-free packages (engine/text, engine/kv but mover.py, engine/sched, router/) import no torch at import
  time: their module-level imports, followed through duet's own modules and packages, never reach torch;
- no product module over ~400 lines (STYLE.md 7);
- ``ruff check`` finds nothing (pyproject.toml [tool.ruff]; ``make lint``).

The checks are functions of a source root, so the tests below also plant a cycle, an undocumented module and a
torch import in a copy and see each one caught.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "router", "bench", "cluster", "prefill_worker", "decode_worker", "kvtransfer", "kernels", "proto")
TORCH_FREE = ("engine.text", "engine.kv", "engine.sched", "router")
TORCH_ALLOWED = ("engine.kv.mover",)  # the bytes of the lower tiers
TORCH = ("torch", "triton")
MAX_LINES = 400


def is_generated(path: Path) -> bool:
    return path.name.endswith(("_pb2.py", "_pb2_grpc.py"))


def modules(root: Path, tops: tuple[str, ...] = PRODUCT) -> dict[str, Path]:
    """Dotted name -> file of every module under ``tops`` (a package is its ``__init__.py``)."""
    out = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" in path.parts or is_generated(path):
                continue
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """``(module, line, at_import_time)`` for every import in the file but those under ``if TYPE_CHECKING:``.
    ``from a import b`` names module ``a.b`` when that is a module of ours, else ``a``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub, top_level)
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, top_level) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    out.append((full if full in known else base, child.lineno, top_level))
            inner = top_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return out


def import_graph(root: Path, tops: tuple[str, ...] = PRODUCT, import_time_only: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (each import's module, and the packages above it, which run
    first). External modules appear as edges too (``torch``), with no edges of their own."""
    mods = modules(root, tops)
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = graph.setdefault(name, set())
        for mod, _, at_import in imports(path, name, known):
            if import_time_only and not at_import:
                continue
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                edges.add(".".join(parts[:i]))
        edges.discard(name)
    return graph


def cycles(graph: dict[str, set[str]], packages: set[str] = frozenset()) -> list[list[str]]:
    """Import cycles among the modules (Tarjan's strongly connected components of two or more modules). Edges to
    a package (its ``__init__``) run before the package's modules and are not counted: ``packages``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def succ(v: str) -> list[str]:
        return sorted(w for w in graph.get(v, ()) if w in graph and w not in packages)

    def strong(v: str) -> None:  # iterative Tarjan, so deep graphs do not hit the recursion limit
        work = [(v, iter(succ(v)))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ(w))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def product_cycles(root: Path, tops: tuple[str, ...] = PRODUCT) -> list[list[str]]:
    mods = modules(root, tops)
    packages = {n for n, p in mods.items() if p.name == "__init__.py"}
    return cycles(import_graph(root, tops), packages)


def undocumented(root: Path, tops: tuple[str, ...] = PRODUCT) -> list[str]:
    """``package: name`` for every module (``name.py``) or subpackage (``name/``) its package's docstring
    does not name. Generated protobuf code is left out."""
    missing = []
    for top in tops:
        if top == "proto":
            continue
        for init in sorted((root / top).rglob("__init__.py")):
            pkg = init.parent
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            for child in sorted(pkg.iterdir()):
                if child.suffix == ".py" and child.name != "__init__.py" and not is_generated(child):
                    if child.name not in doc:
                        missing.append(f"{pkg.relative_to(root)}: {child.name}")
                elif child.is_dir() and (child / "__init__.py").exists() and f"{child.name}/" not in doc:
                    missing.append(f"{pkg.relative_to(root)}: {child.name}/")
    return missing


def torch_reached(root: Path, prefixes: tuple[str, ...] = TORCH_FREE,
                  allowed: tuple[str, ...] = TORCH_ALLOWED) -> dict[str, list[str]]:
    """Torch-free module -> the import chain by which it reaches torch when imported (module level only)."""
    graph = import_graph(root, import_time_only=True)
    reached = {}
    for start in sorted(graph):
        if not any(start == p or start.startswith(p + ".") for p in prefixes) or start in allowed:
            continue
        parent = {start: ""}
        queue = [start]
        while queue:
            v = queue.pop(0)
            if v.split(".")[0] in TORCH:
                chain = [v]
                while parent[chain[-1]]:
                    chain.append(parent[chain[-1]])
                reached[start] = chain[::-1]
                break
            for w in sorted(graph.get(v, ())):
                if w not in parent:
                    parent[w] = v
                    queue.append(w)
    return reached


def long_modules(root: Path, limit: int = MAX_LINES) -> list[str]:
    return [f"{p.relative_to(root)}: {n} lines" for p in modules(root).values()
            if (n := len(p.read_text().splitlines())) > limit]


# ---- the repository ------------------------------------------------------------------------------------------
def test_no_import_cycle():
    assert product_cycles(ROOT) == []


def test_every_module_named_in_its_package_docstring():
    assert undocumented(ROOT) == []


def test_torch_free_packages_import_no_torch():
    assert torch_reached(ROOT) == {}


def test_no_module_over_400_lines():
    assert long_modules(ROOT) == []


def test_every_test_folder_is_a_package():
    """Tests mirror the tree; repeated basenames (tests/engine/kv/test_tiers.py, tests/bench/...) need packages."""
    assert [str(d.relative_to(ROOT)) for d in sorted((ROOT / "tests").rglob("*"))
            if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()] == []


def ruff() -> list[str] | None:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if Path(exe).exists():
        return [exe]
    try:
        import ruff as _ruff  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ruff"]


def test_ruff_finds_nothing():
    cmd = ruff()
    assert cmd is not None, "ruff is not installed: `make install` adds it (the test extras), or pip install ruff"
    done = subprocess.run([*cmd, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


# ---- the checks catch what they are for ---------------------------------------------------------------------
@pytest.fixture
def engine_copy(tmp_path: Path) -> Path:
    """A copy of engine/ (its Python files) to plant things in."""
    shutil.copytree(ROOT / "engine", tmp_path / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_planted_cycle_is_caught(engine_copy: Path):
    assert product_cycles(engine_copy, ("engine",)) == []
    hashing = engine_copy / "engine" / "kv" / "hashing.py"
    # the engine imports the block pool, which imports hashing: hashing importing the engine closes a loop,
    # and it counts from inside a function too
    hashing.write_text(hashing.read_text() + "\n\ndef _planted():\n    from engine.engine import Engine\n")
    found = product_cycles(engine_copy, ("engine",))
    assert found and any({"engine.engine", "engine.kv.hashing"} <= set(c) for c in found), found


def test_a_type_checking_import_is_no_cycle(engine_copy: Path):
    hashing = engine_copy / "engine" / "kv" / "hashing.py"
    hashing.write_text(hashing.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                             "    from engine.engine import Engine\n")
    assert product_cycles(engine_copy, ("engine",)) == []


def test_a_planted_undocumented_module_is_caught(engine_copy: Path):
    assert undocumented(engine_copy, ("engine",)) == []
    (engine_copy / "engine" / "kv" / "planted.py").write_text('"""Nobody listed me."""\n')
    (engine_copy / "engine" / "planted_pkg").mkdir()
    (engine_copy / "engine" / "planted_pkg" / "__init__.py").write_text('"""Pieces:\n"""\n')
    assert undocumented(engine_copy, ("engine",)) == ["engine: planted_pkg/", "engine/kv: planted.py"]


def test_a_planted_torch_import_is_caught(engine_copy: Path):
    shutil.copytree(ROOT / "router", engine_copy / "router", ignore=shutil.ignore_patterns("__pycache__"))
    assert torch_reached(engine_copy) == {}
    # a torch-free module importing one that imports torch, at module level
    stopping = engine_copy / "engine" / "text" / "stopping.py"
    stopping.write_text(stopping.read_text() + "\nfrom engine.models import layers  # noqa\n")
    reached = torch_reached(engine_copy)
    assert reached["engine.text.stopping"] == ["engine.text.stopping", "engine.models.layers", "torch"]
    assert "router.http.app" in reached  # the router tokenizes with engine.text: it reaches torch through it


def test_a_long_module_is_caught(tmp_path: Path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text('"""- long.py"""\n')
    (tmp_path / "engine" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path) == [f"engine/long.py: {MAX_LINES + 1} lines"]
