#!/usr/bin/env python3
"""The house rules the file layout keeps (docs/architecture.md): no source file over 700 lines
and no file-level import cycle inside a crate.

An edge A -> B is any path to B's module in A (`use crate::b::...`, `crate::b::X`, `super::b`,
an intra-doc link, or a name re-exported at the crate root by `pub use b::...`); a strongly
connected component of more than one file is a cycle. Exits 1 with the offenders listed.
"""
import glob
import os
import re
import sys

MAX_LINES = 700
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
srcs = sorted(glob.glob(os.path.join(root, "crates/*/src")) + glob.glob(os.path.join(root, "backends/*/src"))
              + glob.glob(os.path.join(root, "conformance/src")) + glob.glob(os.path.join(root, "conformance/*/src")))


def module_of(src, path):
    parts = os.path.relpath(path, src)[:-3].split(os.sep)
    if parts[-1] in ("lib", "main", "mod"):
        parts = parts[:-1]
    return tuple(parts)


problems = []
for src in srcs:
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs if f.endswith(".rs")]
    mods = {module_of(src, f): f for f in files}
    for f in files:
        n = sum(1 for _ in open(f))
        if n > MAX_LINES:
            problems.append(f"{os.path.relpath(f, root)}: {n} lines (over {MAX_LINES})")
    reexported = {}
    lib = mods.get(())
    if lib:
        for m in re.finditer(r"pub use (?:crate::)?(\w+)::(?:\{([^}]*)\}|(\w+))", open(lib).read()):
            for name in (m.group(2).split(",") if m.group(2) else [m.group(3)]):
                name = name.strip().split("::")[-1].split(" as ")[-1].strip()
                if name and (m.group(1),) in mods:
                    reexported[name] = (m.group(1),)
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        text = re.sub(r"//(?![/!])[^\n]*", "", open(f).read())
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
    index, low, stack, on, counter = {}, {}, [], set(), [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                names = " <-> ".join("/".join(c) or "lib" for c in sorted(comp))
                problems.append(f"{os.path.relpath(src, root)}: import cycle {names}")

    for v in mods:
        if v not in index:
            visit(v)

for p in problems:
    print(p)
print(f"structure: {len(srcs)} crates checked, {len(problems)} problems")
sys.exit(1 if problems else 0)
