#!/usr/bin/env python3
"""The crate's module graph, from its `use` paths, and its import cycles.

    scripts/module-graph.py [--graph]

Reads src/ (test modules and comments left out). Two modules depend on one
another when one names the other through `crate::`, `super::` or `self::`;
each dependency is counted between the siblings it crosses (proxy::h2::pump
naming proxy::h2::streams counts as pump -> streams; replicate naming
config counts at the top level), and a module and its own children are not
a cycle. Prints every cycle (a set of siblings that name one another round)
and exits 1 if there is one; --graph also prints the top-level graph.
"""
import collections
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
USE = re.compile(r"\buse\s+((?:crate|super|self)(?:::\w+)+)(?:::\{([^;]*)\})?")
PATH = re.compile(r"\b((?:crate|super)(?:::\w+)+)::")


def module_of(path):
    parts = os.path.relpath(path, ROOT)[:-3].split("/")
    return tuple(parts[:-1] if parts[-1] in ("mod", "lib", "main") else parts)


def sources():
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".rs"):
                text = open(os.path.join(d, f)).read()
                text = text.split("#[cfg(test)]")[0]
                lines = [l for l in text.split("\n") if not l.strip().startswith("//")]
                out[module_of(os.path.join(d, f))] = "\n".join(lines)
    return out


def resolve(mods, here, segs):
    if segs[0] == "crate":
        base, segs = [], segs[1:]
    elif segs[0] == "self":
        base, segs = list(here), segs[1:]
    else:
        base = list(here)
        while segs and segs[0] == "super":
            base, segs = base[:-1], segs[1:]
    full = base + segs
    for i in range(len(full), 0, -1):
        if tuple(full[:i]) in mods:
            return tuple(full[:i])
    return None


def sibling_edges(src):
    mods = set(src)
    edges = collections.defaultdict(set)
    for m, text in src.items():
        named = []
        for path, group in USE.findall(text):
            segs = path.split("::")
            named.append(segs)
            for item in re.split(r",\s*", group or ""):
                item = item.strip().split(" ")[0].split("::")[0].strip("{} \n")
                if item and item != "self":
                    named.append(segs + [item])
        named += [p.split("::") for p in PATH.findall(text)]
        for segs in named:
            t = resolve(mods, m, segs)
            if not t or t == m or t[: len(m)] == m or m[: len(t)] == t:
                continue
            k = 0
            while m[k] == t[k]:
                k += 1
            edges[m[: k + 1]].add(t[: k + 1])
    return edges


def cycles(edges):
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                found.append(sorted("::".join(c) for c in comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def main():
    edges = sibling_edges(sources())
    if "--graph" in sys.argv[1:]:
        for a in sorted(e for e in edges if len(e) == 1):
            print(a[0], "->", " ".join(sorted(b[0] for b in edges[a])))
    found = cycles(edges)
    for c in found:
        print("import cycle:", " <-> ".join(c))
    print(f"{len(found)} import cycle(s) in src/")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
