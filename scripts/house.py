#!/usr/bin/env python3
"""The house rules of src/ and python/, checked (scripts/test runs this):

1. no file over 600 lines in src/ and python/;
2. no import cycle between the files of src/ (test-only code aside);
3. no arrow running back up: a module uses only the layers below it (LAYERS).

    python3 scripts/house.py [--graph]    (--graph prints the layer-to-layer edges)
"""

import collections
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_LINES = 600
# Each top-level module of src/ and its layer: a module may use modules of lower layers only.
LAYERS = {
    "sync": 0, "nvtx": 0, "dlpack": 0, "stamps": 0,
    "driver": 1,
    "error": 2,
    "cuda": 3,
    "host": 4,
    "ring": 5,
    "d2h": 6,
    "h2d": 7, "step": 7, "blocks": 7,
    "python": 8,
    "testing": 9, "lib": 9,
}


def strip(text):
    """Comments, string contents and `#[cfg(test)]` modules removed; lines kept."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r'r(#*)".*?"\1', lambda m: '""' + "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', lambda m: '""' + "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"'(\\.|[^\\'])'", "' '", text)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        depth, j = 1, m.end()
        while depth and j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        out.append(text[i : m.start()])
        out.append("\n" * text.count("\n", m.start(), j))
        i = j
    out.append(text[i:])
    return "".join(out)


def modpath(rel):
    parts = rel[:-3].split("/")
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return ("crate", *parts)


def use_paths(tree):
    """`a::{b, c::d as e}` -> [(['a','b'], None), (['a','c','d'], 'e')]."""
    tree = re.sub(r"\s+as\s+", " AS ", tree)
    tree = re.sub(r"\s+", "", tree).replace("AS", " as ")
    out = []

    def rec(prefix, t):
        if "{" in t and t.endswith("}"):
            k = t.index("{")
            parts, depth, cur = [], 0, ""
            for ch in t[k + 1 : -1]:
                depth += {"{": 1, "}": -1}.get(ch, 0)
                if ch == "," and depth == 0:
                    parts.append(cur)
                    cur = ""
                else:
                    cur += ch
            parts += [cur] if cur else []
            for p in parts:
                rec(prefix + t[:k], p)
        else:
            alias = None
            if " as " in t:
                t, alias = t.split(" as ")
            segs = (prefix + t).split("::")
            out.append((segs[:-1] if segs[-1] == "self" else segs, alias))

    rec("", tree)
    return out


class Crate:
    def __init__(self, src):
        self.files = {modpath(str(p.relative_to(src))): str(p.relative_to(src)) for p in src.rglob("*.rs")}
        self.text = {mp: strip((src / rel).read_text()) for mp, rel in self.files.items()}
        self.children = {
            mp: set(re.findall(r"(?m)^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", t))
            for mp, t in self.text.items()
        }
        self.reexports = {mp: {} for mp in self.files}
        for mp, t in self.text.items():
            for m in self.uses(t, public=True):
                for segs, alias in use_paths(m.group(2)):
                    if segs[0] in ("crate", "self", "super") or segs[0] in self.children[mp]:
                        a = self.absolute(mp, segs)
                        self.reexports[mp][alias or a[-1]] = a

    @staticmethod
    def uses(text, public=None):
        for m in re.finditer(r"(?m)^[ \t]*(pub(?:\([^)]*\))?[ \t]+)?use[ \t]+([^;]*);", text):
            if public is None or bool(m.group(1)) == public:
                yield m

    def absolute(self, mp, segs):
        if segs[0] == "crate":
            return list(segs)
        base, segs = list(mp), list(segs)
        if segs[0] == "self":
            return base + segs[1:]
        while segs and segs[0] == "super":
            base, segs = base[:-1], segs[1:]
        return base + segs

    def resolve(self, segs, depth=0):
        cur, i = ("crate",), 1
        while i < len(segs):
            nxt = cur + (segs[i],)
            if nxt in self.files:
                cur, i = nxt, i + 1
                continue
            target = self.reexports.get(cur, {}).get(segs[i])
            if target and depth < 20:
                return self.resolve(list(target) + segs[i + 1 :], depth + 1)
            return cur
        return cur

    def edges(self):
        """(source file, target file, line) for every crate-internal reference."""
        for mp, rel in self.files.items():
            text, aliases = self.text[mp], {}
            body = text
            for m in self.uses(text):
                body = body[: m.start()] + re.sub(r"[^\n]", " ", m.group(0)) + body[m.end() :]
                line = text.count("\n", 0, m.start()) + 1
                for segs, alias in use_paths(m.group(2)):
                    if segs[0] in ("crate", "self", "super") or segs[0] in self.children[mp]:
                        a = self.absolute(mp, segs)
                        tgt = self.resolve(a)
                        if not m.group(1):
                            yield rel, self.files[tgt], line
                        if tuple(a) in self.files:
                            aliases[alias or segs[-1]] = tuple(a)
            heads = ["crate", "super", "self", *sorted(self.children[mp] | set(aliases))]
            pat = re.compile(r"(?<![\w:])((?:" + "|".join(map(re.escape, heads)) + r")(?:::\w+)+)")
            for m in pat.finditer(body):
                segs = m.group(1).split("::")
                a = list(aliases[segs[0]]) + segs[1:] if segs[0] in aliases else self.absolute(mp, segs)
                yield rel, self.files[self.resolve(a)], body.count("\n", 0, m.start()) + 1


def cycles(graph):
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main():
    problems = []
    for path in sorted([*SRC.rglob("*.rs"), *SRC.rglob("*.py"), *(ROOT / "python").rglob("*.py*")]):
        n = path.read_text().count("\n")
        if n > MAX_LINES:
            problems.append(f"{path.relative_to(ROOT)}: {n} lines (at most {MAX_LINES})")
    crate = Crate(SRC)
    graph = collections.defaultdict(set)
    layer_edges = collections.Counter()
    top = lambda rel: rel.split("/")[0].removesuffix(".rs")  # noqa: E731
    for src, tgt, line in crate.edges():
        if src == tgt:
            continue
        graph[src].add(tgt)
        graph[tgt]
        s, t = top(src), top(tgt)
        if s == t:
            continue
        layer_edges[(s, t)] += 1
        if s not in LAYERS or t not in LAYERS:
            problems.append(f"src/{src}:{line}: module {s if s not in LAYERS else t} has no layer in LAYERS")
        elif LAYERS[t] >= LAYERS[s]:
            problems.append(f"src/{src}:{line}: {s} (layer {LAYERS[s]}) uses {tgt} ({t}, layer {LAYERS[t]})")
    for comp in cycles(graph):
        problems.append("import cycle: " + " -> ".join(comp))
    if "--graph" in sys.argv:
        for (s, t), n in sorted(layer_edges.items()):
            print(f"{s} -> {t}: {n}")
    for p in problems:
        print("FAIL:", p)
    print(f"house: {len(crate.files)} files, {sum(len(v) for v in graph.values())} file edges, "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
