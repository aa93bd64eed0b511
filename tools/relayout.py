"""Issue 47: engine/, router/ and bench/ (and tests/) by concept — the exact module map, and the rewrite.

    python tools/relayout.py            # git mv every row whose source exists, then rewrite references
    python tools/relayout.py --check    # list what would change, change nothing

Re-runnable: after merging work done against the old layout, run it again. Rows whose old file is absent are
skipped (``engine/call_lists.py`` is in the map before it exists); a row whose old file exists again (a new or
re-added file in main) is moved, as long as its new path is free. References are rewritten with the exact map
(tools/relayout_map.py), never a prefix: config keys such as ``engine.kv_host_bytes`` or ``router.local_prefill_max_tokens`` are not
module paths and stay as they are.

What is rewritten, in every text file under the repository (but .git, build outputs and tools/):
  * in Python, by the AST: ``from pkg import module`` where ``pkg.module`` moved, and ``from split import a, b``
    where the names of a split module went to different modules (``SPLITS``); by the tokenizer: dotted module
    paths and ``pkg/module.py`` paths inside strings and comments (``monkeypatch.setattr("engine.x.y", …)``,
    ``getLogger("router.events")``, docstrings), and the module of ``import a.b`` / ``from a.b import``;
  * in Markdown, YAML, shell, Makefile, TOML, Dockerfiles: dotted paths (``python -m bench.bench_engine``) and
    file paths (``engine/kv_tiers.py``), and the moved folders (``engine/spec/``, ``bench/calibration/``);
  * ``ModelConfig.from_checkpoint(`` / ``Tokenizer.from_checkpoint(`` → ``load_model_config(`` /
    ``load_tokenizer(`` (engine/loading/checkpoint.py), with the import added.

Attribute chains in code (``engine.scheduler.waiting`` on an ``Engine`` called ``engine``) are never touched:
only import statements, strings and comments carry module paths in Python.

After merging main's work on the old layout into this one:

    python tools/relayout.py                 # moves new files at old paths (engine/call_lists.py), rewrites references
    .venv/bin/python -m ruff check --fix .   # import order of the rewritten imports
    .venv/bin/python -m pytest -q tests/test_layout.py   # cycles, package docstrings, torch-free, size, ruff

Markdown between ``<!-- relayout: keep -->`` and ``<!-- relayout: end -->`` names the old layout on purpose and
is left alone.

Old names that are new names too (``engine.config`` was ``ModelConfig``'s module and is now ``EngineConfig``'s;
``router.metrics`` was a module and is now a folder) are rewritten bare only on the first run (``--first``, done);
``old.Name`` resolves either way (see ``FIRST_RUN_ONLY``).
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from relayout_map import (  # noqa: E402  (run as a script: tools/ is on sys.path)
    CALLS,
    CALLS_MODULE,
    CONFIG_KEYS,
    DIR_MOVES,
    FIRST_RUN_ONLY,
    MAIN_MODULES,
    MERGED,
    MOVES,
    SPLITS,
)

SKIP_DIRS = {".git", ".venv", "build", ".cache", "node_modules", "__pycache__", "tools", ".pytest_cache", "duet.egg-info"}
# Markdown between these markers names the old layout on purpose (docs/ARCHITECTURE.md's departures): left alone
KEEP_START, KEEP_END = "<!-- relayout: keep -->", "<!-- relayout: end -->"
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".json", ".j2"}
TEXT_NAMES = {"Makefile", "Dockerfile", "README"}
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")


def module_of(path: str) -> str:
    mod = path.removesuffix(".py").replace("/", ".")
    return mod.removesuffix(".__init__")


def module_map(first: bool) -> dict[str, str]:
    """Old dotted module -> new dotted module (the exact map; split modules map to where their file went)."""
    m = {module_of(old): module_of(new) for old, new in MOVES}
    for old, new in DIR_MOVES:
        if not old.startswith("bench/"):  # data folders are not modules
            m.setdefault(module_of(old), module_of(new))
    m["engine.config"] = "engine.models.config"
    return m


def path_map(first: bool) -> dict[str, str]:
    p = {old: new for old, new in MOVES if old != "engine/config.py"}
    p.update({old + "/": new + "/" for old, new in DIR_MOVES})
    if first:
        p["engine/config.py"] = FIRST_RUN_ONLY["engine/config.py"]
    return p


class Rewriter:
    def __init__(self, first: bool) -> None:
        self.mods = module_map(first)
        self.paths = path_map(first)
        self.first = first
        self.new_mods = {module_of(new) for _, new in MOVES} | {"engine.loading.paths", "engine.sched.output",
                                                                  "prefill_worker.event_sinks", "bench.sim.runs"}
        self.new_mods |= {m.rpartition(".")[0] for m in self.new_mods}  # and their packages
        self.ambiguous = {old for old in self.mods if old in self.new_mods}  # see FIRST_RUN_ONLY
        keys = sorted(self.mods, key=len, reverse=True)
        # a dotted path: not part of a longer name on the left; optionally followed by .Name
        self.dotted = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, keys)) + r")(?![\w])((?:\.[A-Za-z_]\w*)?)")
        pkeys = sorted(self.paths, key=len, reverse=True)
        self.pathre = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, pkeys)) + r")")

    # -- names
    def target(self, old_mod: str, name: str | None) -> str:
        """Where ``name`` of old module ``old_mod`` lives now (the module itself when name is None)."""
        split = SPLITS.get(old_mod, {})
        if name is not None and name in split:
            return split[name]
        return self.mods.get(old_mod, old_mod)

    def sub_dotted(self, text: str) -> str:
        def repl(m: re.Match) -> str:
            old, rest = m.group(1), m.group(2)
            name = rest[1:] if rest else None
            if name and (f"{old}.{name}" in self.mods or f"{old}.{name}" in self.new_mods):
                return m.group(0)  # a longer old key (matched first anyway) or a module of the new tree
            if not name and old in self.ambiguous and not self.first:
                return m.group(0)
            if not name and old in CONFIG_KEYS and not self.in_import:
                return m.group(0)
            return self.target(old, name) + rest
        return self.dotted.sub(repl, text)

    in_import = False

    def sub_string(self, text: str) -> str:
        """A string token: an f-string's {expressions} are code (``{engine.scheduler.running}``), left alone."""
        prefix = re.match(r"[A-Za-z]*", text).group(0)
        if "f" not in prefix.lower():
            return self.sub_text(text)
        parts = re.split(r"(\{[^{}]*\})", text)
        return "".join(p if p.startswith("{") and p.endswith("}") else self.sub_text(p) for p in parts)

    def sub_paths(self, text: str) -> str:
        return self.pathre.sub(lambda m: self.paths[m.group(1)], text)

    def sub_text(self, text: str) -> str:
        text = self.sub_dotted(self.sub_paths(text))
        for old, new in MAIN_MODULES.items():  # `python -m bench.sim`, not `-m bench.sim.__main__`
            text = text.replace(old, new)
        return text

    # -- Python
    def import_from(self, node: ast.ImportFrom) -> list[tuple[str, list[str]]] | None:
        """The statements that replace ``node`` ([(module, ["a", "b as c"])]), or None to keep it."""
        if node.level or node.module is None:
            return None
        mod = node.module
        out: dict[str, list[str]] = {}
        changed = False
        for alias in node.names:
            full = f"{mod}.{alias.name}"
            if full in self.new_mods and (full not in self.mods or not self.first):  # from new_pkg import new_module
                out.setdefault(mod, []).append(alias.name + (f" as {alias.asname}" if alias.asname else ""))
                continue
            if full in self.mods and full not in SPLITS.get(mod, {}):  # from pkg import module
                new = self.mods[full]
                parent, _, leaf = new.rpartition(".")
                asname = alias.asname or (alias.name if leaf != alias.name else None)
                text = leaf + (f" as {asname}" if asname and asname != leaf else "")
                out.setdefault(parent, []).append(text)
                changed = True
                continue
            new_mod = self.target(mod, alias.name)
            changed |= new_mod != mod
            text = alias.name + (f" as {alias.asname}" if alias.asname else "")
            out.setdefault(new_mod, []).append(text)
        return list(out.items()) if changed else None

    def rewrite_python(self, src: str) -> str:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            return self.sub_text(src)
        lines = src.splitlines(keepends=True)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line))

        def pos(lineno: int, col: int) -> int:
            return offsets[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))

        spans: list[tuple[int, int, str]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                stmts = self.import_from(node)
                if stmts is not None:
                    indent = " " * node.col_offset
                    text = ("\n" + indent).join(format_from(mod, names, len(indent)) for mod, names in stmts)
                    spans.append((pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset), text))
        edits = spans + [e for e in self.token_edits(src, offsets)
                         if not any(a <= e[0] < b for a, b, _ in spans)]
        for start, end, text in sorted(edits, reverse=True):
            src = src[:start] + text + src[end:]
        return self.add_call_imports(src)

    def token_edits(self, src: str, offsets: list[int]) -> list[tuple[int, int, str]]:
        """Strings and comments get the text rewrite; the module after ``import`` / ``from`` the dotted one."""
        toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
        edits: list[tuple[int, int, str]] = []

        def at(p: tuple[int, int]) -> int:
            return offsets[p[0] - 1] + p[1]

        i = 0
        while i < len(toks):
            tok = toks[i]
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                new = self.sub_string(tok.string) if tok.type == tokenize.STRING else self.sub_text(tok.string)
                if new != tok.string:
                    edits.append((at(tok.start), at(tok.end), new))
            elif tok.type == tokenize.NAME and tok.string == "import" and \
                    (i == 0 or toks[i - 1].type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)
                     or toks[i - 1].string in (";", ":")):  # `import a.b` (from-imports are the AST's)
                j, parts = i + 1, []
                while j < len(toks) and (toks[j].type == tokenize.NAME or toks[j].string == "."):
                    if toks[j].type == tokenize.NAME and parts and parts[-1] != ".":
                        break
                    parts.append(toks[j].string)
                    j += 1
                dotted = "".join(parts)
                self.in_import = True
                new = self.sub_dotted(dotted) if dotted else dotted
                self.in_import = False
                if new != dotted:
                    edits.append((at(toks[i + 1].start), at(toks[j - 1].end), new))
                i = max(j, i + 1)
                continue
            i += 1
        return edits

    def add_call_imports(self, src: str) -> str:
        needed = []
        for old, new in CALLS.items():
            if old in src:
                src = src.replace(old, new)
            func = new.rstrip("(")
            if re.search(rf"(?<![\w.]){func}\(", src) and not re.search(rf"import [^\n]*\b{func}\b", src) \
                    and not re.search(rf"^def {func}\(", src, re.M):
                needed.append(func)
        if not needed:
            return src
        line = f"from {CALLS_MODULE} import {', '.join(sorted(needed))}\n"
        tree = ast.parse(src)
        first = next((n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                      and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")), None)
        lines = src.splitlines(keepends=True)
        at = first.lineno - 1 if first else len(lines)
        return "".join(lines[:at] + [line] + lines[at:])


def format_from(mod: str, names: list[str], indent: int, width: int = 120) -> str:
    one = f"from {mod} import {', '.join(names)}"
    if indent + len(one) <= width:
        return one
    head = f"from {mod} import ("
    rows, cur = [], head
    for k, name in enumerate(names):
        piece = name + (", " if k < len(names) - 1 else ")")
        if indent + len(cur) + len(piece.rstrip()) > width and cur != head:
            rows.append(cur.rstrip())
            cur = " " * len(head)
        cur += piece
    rows.append(cur)
    return ("\n" + " " * indent).join(rows)


def text_files() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        if GENERATED.search(path.name):
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES or path.name.startswith("Dockerfile"):
            out.append(path)
    return out


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def move(check: bool, first: bool) -> list[str]:
    done = []
    for old, new in MOVES:
        if old in MERGED or not (ROOT / old).exists() or (old in FIRST_RUN_ONLY and not first):
            continue
        if (ROOT / new).exists():
            print(f"  ! {old}: {new} exists; merge it by hand", file=sys.stderr)
            continue
        done.append(f"{old} -> {new}")
        if not check:
            (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
            git("mv", old, new)
    for old, new in DIR_MOVES:
        if old.startswith("bench/") and (ROOT / old).is_dir() and not (ROOT / new).exists():
            done.append(f"{old}/ -> {new}/")
            if not check:
                (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
                git("mv", old, new)
    return done


def rewrite(check: bool, first: bool) -> list[str]:
    rw = Rewriter(first)
    changed = []
    for path in text_files():
        try:
            src = path.read_text()
        except UnicodeDecodeError:
            continue
        if path.suffix == ".py":
            new = rw.rewrite_python(src)
        else:
            parts = re.split(f"({re.escape(KEEP_START)}.*?{re.escape(KEEP_END)})", src, flags=re.S)
            new = "".join(p if p.startswith(KEEP_START) else rw.sub_text(p) for p in parts)
        if new != src:
            changed.append(str(path.relative_to(ROOT)))
            if not check:
                path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="say what would change; change nothing")
    ap.add_argument("--first", action="store_true", help="also map the old engine.config (the first run only)")
    ap.add_argument("--no-move", action="store_true", help="rewrite references only")
    args = ap.parse_args(argv)
    if not args.no_move:
        for line in move(args.check, args.first):
            print("mv", line)
    for name in rewrite(args.check, args.first):
        print("rewrote", name)


if __name__ == "__main__":
    main()
