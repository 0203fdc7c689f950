#!/usr/bin/env python3
"""The house rules the source layout keeps (docs/architecture.md), checked over every Rust
source folder of the workspace (crates, backends, conformance, behaviour, the Python
package's Rust sources):

1. no source file over 700 lines;
2. no import cycle between folders: a folder (or a file directly in a crate's `src/`) is the
   unit; files inside one folder may import each other freely, but two units of one folder
   (its subfolders, and its own files taken together) may not import each other both ways.
   An edge A -> B is any path to B's module in A (`use crate::b::...`, `crate::b::X`,
   `super::b`, an intra-doc link in a module's `//!` docs, or a name re-exported at the
   crate root by `pub use b::...`); links in item docs (`///`: an error type's docs name the
   types that raise it) and test modules (`#[cfg(test)] mod tests`) are left out;
3. the folder rule: a type's `impl` blocks stay in one folder (a type whose methods need
   several files gets a folder named after it); a file directly in a crate's `src/` is its
   own unit, since `src/` holds the whole crate;
4. no library function over 80 lines unless a comment right above it (among its doc comment
   and attributes) says why, starting `// Long:`. Functions in test code are not counted.

Every offence is an error, in every crate (the allow-lists the rules began with are
empty and gone).

Then the Python sources (`ci/structure_python.py`, the same rules in Python's terms: no
module over 500 lines, no function over 80 lines, no import cycle between modules or between
the subpackages of a package, in the `kvvm` package, its benchmarks and, for the length, its
tests; and every public item of the package documented), with no allow-list either.

Exits 1 with the problems listed.
"""
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import structure_python  # noqa: E402 (beside this script: the Python rules and the cycle search)

MAX_LINES = 700
MAX_FN_LINES = 80
root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
srcs = sorted(set(
    glob.glob(os.path.join(root, "crates/*/src")) + glob.glob(os.path.join(root, "backends/*/src"))
    + glob.glob(os.path.join(root, "conformance/src")) + glob.glob(os.path.join(root, "conformance/*/src"))
    + glob.glob(os.path.join(root, "behaviour/src")) + glob.glob(os.path.join(root, "crates/python/src"))))


def rel(path):
    return os.path.relpath(path, root)


def module_of(src, path):
    parts = os.path.relpath(path, src)[:-3].split(os.sep)
    if parts[-1] in ("lib", "main", "mod"):
        parts = parts[:-1]
    return tuple(parts)


def blank_code(text):
    """`text` with comments, strings and char literals blanked (newlines kept), so that
    braces and keywords can be counted."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 12]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = len(re.match(r"r(#*)", text[i:]).group(1))
            end = text.find('"' + "#" * hashes, i + 2 + hashes)
            j = n if end < 0 else end + 1 + hashes
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'\n])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def test_ranges(code):
    """Line ranges (0-based, inclusive) of `#[cfg(test)]` items in blanked `code`."""
    ranges = []
    for m in re.finditer(r"#\[cfg\(test\)\]", code):
        open_at = code.find("{", m.end())
        semi = code.find(";", m.end())
        if open_at < 0 or (0 <= semi < open_at):
            continue
        close = match_brace(code, open_at)
        ranges.append((code.count("\n", 0, m.start()), code.count("\n", 0, close)))
    return ranges


def match_brace(code, open_at):
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def in_ranges(line, ranges):
    return any(a <= line <= b for a, b in ranges)


problems = []

for src in srcs:
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs if f.endswith(".rs"))
    mods = {module_of(src, f): f for f in files}
    texts = {f: open(f).read() for f in files}
    codes = {f: blank_code(t) for f, t in texts.items()}
    tests = {f: test_ranges(codes[f]) for f in files}
    is_test_file = {f: os.path.basename(f) in ("tests.rs",) or f.endswith("_tests.rs")
                    or any(a == 0 and b >= codes[f].count("\n") - 1 for a, b in tests[f]) for f in files}

    # 1. file length
    for f in files:
        n = texts[f].count("\n") + (0 if texts[f].endswith("\n") or not texts[f] else 1)
        if n > MAX_LINES:
            problems.append(f"{rel(f)}: {n} lines (over {MAX_LINES})")

    # 2. cycles between folders
    reexported = {}
    lib = mods.get(())
    if lib:
        for m in re.finditer(r"pub use (?:crate::)?(\w+)::(?:\{([^}]*)\}|(\w+))", texts[lib]):
            for name in (m.group(2).split(",") if m.group(2) else [m.group(3)]):
                name = name.strip().split("::")[-1].split(" as ")[-1].strip()
                if name and (m.group(1),) in mods:
                    reexported[name] = (m.group(1),)
    folders = set()
    for f in files:
        d = os.path.relpath(os.path.dirname(f), src)
        parts = () if d == "." else tuple(d.split(os.sep))
        folders.update(parts[:k] for k in range(len(parts) + 1))
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        # Line comments go, and so do item docs: `///` loses its last two slashes here.
        text = re.sub(r"//(?![/!])[^\n]*", "", texts[f])
        cut = re.search(r"#\[cfg\(test\)\]\s*mod tests", text)
        if cut:
            text = text[: cut.start()]
        refs = {tuple(x.split("::")) for x in re.findall(r"\bcrate::((?:\w+::)*\w+)", text)}
        for group in re.findall(r"use crate::\{([^}]*)\}", text):
            for item in re.sub(r"\{[^}]*\}", "", group).split(","):
                if item.strip():
                    refs.add(tuple(item.strip().split("::")))
        for x in re.findall(r"\bsuper::((?:\w+::)*\w+)", text):
            refs.add(m[:-1] + tuple(x.split("::")))
        for r in refs:
            if r[:1] not in mods and r and r[0] in reexported:
                r = reexported[r[0]] + r[1:]
            for k in range(len(r), 0, -1):
                if r[:k] in mods and r[:k] != m:
                    edges[m].add(r[:k])
                    break

    def unit_in(folder, m):
        """The unit of module `m` inside `folder`: its subfolder there, or the folder's own
        files (`.`); None when `m` is outside the folder."""
        if m[:len(folder)] != folder:
            return None
        rest = m[len(folder):]
        if not rest:
            return "."
        if folder + rest[:1] in folders:
            return rest[0] + "/"
        # A file directly in `src/` is a unit of its own; in a folder, the folder's files are one.
        return rest[0] if folder == () else "."

    for folder in sorted(folders):
        graph = {}
        for a, targets in edges.items():
            ua = unit_in(folder, a)
            if ua is None:
                continue
            for b in targets:
                ub = unit_in(folder, b)
                if ub is None or ub == ua:
                    continue
                graph.setdefault(ua, set()).add(ub)
                graph.setdefault(ub, set())
        for comp in structure_python.cycles(graph):
            where = os.path.join(rel(src), *folder)
            problems.append(f"{where}: import cycle between {' <-> '.join(comp)}")

    # 3. the folder rule
    impl_re = re.compile(r"^[ \t]*(?:unsafe\s+)?impl\b\s*(<[^{;]*?>)?\s*([^{;]*?)\s*(?:where\b[^{]*)?\{", re.M)
    homes = {}
    for f in files:
        if is_test_file[f]:
            continue
        code = codes[f]
        for m in impl_re.finditer(code):
            line = code.count("\n", 0, m.start())
            if in_ranges(line, tests[f]):
                continue
            head = m.group(2)
            target = head.split(" for ", 1)[1] if " for " in head else head
            name = re.sub(r"<.*", "", target).strip().split("::")[-1].strip("&' ")
            generics = m.group(1) or ""
            if not re.match(r"^[A-Z]\w*$", name) or re.search(r"\b" + name + r"\b", generics):
                continue
            d = os.path.dirname(f)
            unit = os.path.relpath(f, src) if d == src else os.path.relpath(d, src) + "/"
            homes.setdefault(name, {}).setdefault(unit, []).append(f)
    for name, units in sorted(homes.items()):
        if len(units) > 1:
            problems.append(f"{rel(src)}: impl blocks of `{name}` span {', '.join(sorted(units))} "
                            "(give it a folder named after it)")

    # 4. long functions
    fn_re = re.compile(r"\bfn\s+(\w+)")
    for f in files:
        if is_test_file[f]:
            continue
        code, lines = codes[f], texts[f].split("\n")
        for m in fn_re.finditer(code):
            start = code.count("\n", 0, m.start())
            if in_ranges(start, tests[f]):
                continue
            brace, semi = code.find("{", m.end()), code.find(";", m.end())
            if brace < 0 or (0 <= semi < brace):
                continue
            end = code.count("\n", 0, match_brace(code, brace))
            length = end - start + 1
            if length <= MAX_FN_LINES:
                continue
            # The comment block above: doc comments, attributes and `//` lines.
            k, why = start - 1, False
            while k >= 0 and re.match(r"\s*(//|#\[|#!\[)", lines[k]):
                why = why or re.match(r"\s*// Long:", lines[k]) is not None
                k -= 1
            if why:
                continue
            problems.append(f"{rel(f)}:{start + 1}: fn {m.group(1)} is {length} lines "
                            f"(over {MAX_FN_LINES}, no `// Long:` comment)")

rust_problems = len(problems)
py_problems, py_modules = structure_python.check(root)
problems += py_problems
for p in problems:
    print(p)
print(f"structure: {len(srcs)} Rust source folders checked, {rust_problems} problems; "
      f"{py_modules} Python modules checked, {len(py_problems)} problems")
sys.exit(1 if problems else 0)
