"""The house rules over the Python sources (ci/structure.py runs them after the Rust ones):

1. no module over 500 lines (the package, its benchmarks and its tests);
2. no function over 80 lines, from its `def` to its last line, nested functions counted on
   their own too (the package and the benchmarks; test functions are not counted);
3. no import cycle, read from every `import` and `from ... import` of a module wherever it
   stands (module level, inside a function, under `if TYPE_CHECKING:`), in two ways:
   - between modules: `from . import x` names the module `x` when it is one, else the
     package's `__init__`; a module that imports a name from its own package's `__init__`
     while that `__init__` imports it back is a cycle like any other;
   - between the units of each package, as the Rust rule has them between folders: inside a
     package, each subpackage (with everything below it) is one unit and each module of the
     package itself is one, so two subpackages never import each other both ways, even
     through different modules.

4. every public item of the package (`crates/python/python`) documented: each module, each
   module-level function and class whose name does not start with `_`, and each such method
   of such a class (a Protocol's stub, whose body is `...`, a property's setter and an
   `@overload` need none: the item they stand for carries it).

An import of a parent package that Python runs implicitly (`kvvm.transformers` runs
`kvvm/__init__.py` first) is not an edge: only what a module names is. There is no allow-list.
"""
import ast
import os
import sys

MAX_LINES = 500
MAX_FN_LINES = 80

# (folder holding top-level packages, whether its functions and imports are checked).
ROOTS = [
    ("crates/python/python", True),
    ("crates/python/benches", True),
    ("crates/python/tests", False),
]


def modules_under(root):
    """`{dotted module name: path}` of every `.py` file below `root` (a package's
    `__init__.py` is the package's own name)."""
    found = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            parts = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts:
                found[".".join(parts)] = os.path.join(d, f)
    return found


def imported(name, path, tree, known):
    """The modules of `known` that module `name` (at `path`) names in its imports."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in known:
                    out.add(sub)
                elif target in known:
                    out.add(target)
    out.discard(name)
    return out


def cycles(graph):
    """The strongly connected components of more than one node of `graph` (Tarjan)."""
    index, low, stack, on, counter, comps = {}, {}, [], set(), [0], []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def unit_cycles(edges, packages):
    """Cycles between the units of each package: a subpackage (all below it) or a module of
    the package itself."""
    found = []
    for pkg in sorted(packages):
        prefix = pkg + "." if pkg else ""

        def unit(m):
            if not m.startswith(prefix) or m == pkg:
                return None
            head = m[len(prefix):].split(".")[0]
            return head + "/" if prefix + head in packages else head

        graph = {}
        for a, targets in edges.items():
            ua = unit(a)
            for b in targets:
                ub = unit(b)
                if ua and ub and ua != ub:
                    graph.setdefault(ua, set()).add(ub)
        found += [(pkg, comp) for comp in cycles(graph) if any(u.endswith("/") for u in comp)]
    return found


def _exempt(fn):
    """Whether a function needs no docstring of its own (rule 4)."""
    stub = len(fn.body) == 1 and isinstance(fn.body[0], ast.Expr) and getattr(fn.body[0].value, "value", None) is Ellipsis
    marks = {ast.unparse(d) for d in fn.decorator_list}
    return stub or "overload" in marks or "typing.overload" in marks or any(m.endswith(".setter") for m in marks)


def undocumented(tree):
    """`(line, name)` of every public item of a module without a docstring (rule 4): the
    module (line 1), its public functions and classes, their public methods."""
    found = [] if ast.get_docstring(tree) else [(1, "the module")]
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if not ast.get_docstring(node) and (isinstance(node, ast.ClassDef) or not _exempt(node)):
            found.append((node.lineno, node.name))
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not fn.name.startswith("_")
                        and not ast.get_docstring(fn) and not _exempt(fn)):
                    found.append((fn.lineno, f"{node.name}.{fn.name}"))
    return found


def check_root(repo, root, library):
    problems = []
    mods = modules_under(os.path.join(repo, root))
    rel = {m: os.path.relpath(p, repo) for m, p in mods.items()}
    trees = {}
    for m, p in mods.items():
        text = open(p).read()
        n = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if n > MAX_LINES:
            problems.append(f"{rel[m]}: {n} lines (over {MAX_LINES})")
        trees[m] = ast.parse(text, p)
    if not library:
        return problems
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FN_LINES:
                    problems.append(f"{rel[m]}:{node.lineno}: def {node.name} is {length} lines "
                                    f"(over {MAX_FN_LINES})")
    if root == "crates/python/python":
        for m, tree in trees.items():
            for line, name in undocumented(tree):
                problems.append(f"{rel[m]}:{line}: {name} has no docstring")
    edges = {m: imported(m, mods[m], trees[m], mods) for m in mods}
    for comp in cycles(edges):
        problems.append(f"{root}: import cycle between modules {' <-> '.join(comp)}")
    packages = {m for m, p in mods.items() if p.endswith("__init__.py")} | {""}
    for pkg, comp in unit_cycles(edges, packages):
        problems.append(f"{root}/{pkg.replace('.', '/')}: import cycle between {' <-> '.join(comp)}")
    return problems


def check(repo):
    """Every problem over the Python sources of `repo`, and how many modules were read."""
    problems, count = [], 0
    for root, library in ROOTS:
        problems += check_root(repo, root, library)
        count += len(modules_under(os.path.join(repo, root)))
    return problems, count


if __name__ == "__main__":
    here = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    found, read = check(here)
    for p in found:
        print(p)
    print(f"structure (Python): {read} modules checked, {len(found)} problems")
    sys.exit(1 if found else 0)
