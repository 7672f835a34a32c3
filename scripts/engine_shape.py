#!/usr/bin/env python3
"""The worker engine's shape, measured from the source (docs/BENCHMARKS.md,
"The engine's shape"): Engine's fields and methods and the files they are
spread over, engine/'s size, the longest functions, and the files that
name a model family.

    scripts/engine_shape.py [ROOT] [--family NAME ...]

Text-level counts (a Rust parser is not needed for these): a method is an
`fn` inside an `impl ... Engine<...>` block; a function's length is from
its `fn` line to the matching closing brace.
"""
import re
import subprocess
import sys
from pathlib import Path


def rust_files(root: Path, under: str):
    return sorted(p for p in (root / under).rglob("*.rs") if "target" not in p.parts)


def blocks(text: str, start: int):
    """Index of the brace closing the block opened at or after `start`."""
    depth, i = 0, text.index("{", start)
    while i < len(text):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        elif c == "/" and text.startswith("//", i):
            i = text.index("\n", i)
            continue
        elif c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]):
            i = text.index("'", i + 1)
        i += 1
    return len(text) - 1


def engine_shape(root: Path):
    src = root / "worker/src/engine"
    fields = 0
    for p in rust_files(root, "worker/src/engine"):
        t = p.read_text()
        m = re.search(r"pub struct Engine<[^>]*>\s*\{", t)
        if m:
            body = t[m.end():blocks(t, m.start())]
            fields = len(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?[a-z_][a-z0-9_]*\s*:", body, re.M))
    methods, files, longest = 0, set(), []
    for p in rust_files(root, "worker/src"):
        t = p.read_text()
        for m in re.finditer(r"^impl(?:<[^>]*>)?\s+(?:[\w:]+\s+for\s+)?Engine<[^>]*>\s*\{", t, re.M):
            end = blocks(t, m.start())
            n = len(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?fn\s", t[m.end():end], re.M))
            if n:
                methods += n
                files.add(str(p.relative_to(root)))
        for m in re.finditer(r"^\s*(?:pub(?:\([^)]*\))?\s+)?fn\s+(\w+)", t, re.M):
            if "#[cfg(test)]" in t[:m.start()] and p.name.endswith(("tests.rs",)):
                continue
            end = blocks(t, m.start())
            lines = t[m.start():end].count("\n") + 1
            longest.append((lines, f"{p.relative_to(root)}:{m.group(1)}"))
    longest.sort(reverse=True)
    eng = rust_files(root, "worker/src/engine")
    eng_lines = sum(p.read_text().count("\n") for p in eng)
    return fields, methods, sorted(files), eng_lines, len(eng), longest[:5]


def family_files(root: Path, name: str):
    out = subprocess.run(
        ["git", "-C", str(root), "grep", "-l", "-i", name, "--", "*.rs", "*.proto"],
        capture_output=True, text=True,
    ).stdout.split()
    return [f for f in out if "/tests/" not in f and not f.endswith(("tests.rs", "_tests.rs"))]


def main():
    args = sys.argv[1:]
    families = []
    while "--family" in args:
        i = args.index("--family")
        families.append(args[i + 1])
        del args[i:i + 2]
    root = Path(args[0] if args else ".").resolve()
    fields, methods, files, lines, nfiles, longest = engine_shape(root)
    print(f"Engine fields: {fields}")
    print(f"Engine methods: {methods} in {len(files)} files")
    print(f"engine/: {lines} lines in {nfiles} files")
    for n, what in longest:
        print(f"longest: {n} lines {what}")
    for f in families:
        names = family_files(root, f)
        print(f"files naming {f} (source, tests left out): {len(names)} in "
              f"{len({n.split('/')[0] for n in names})} crates")
        for n in names:
            print(f"  {n}")


if __name__ == "__main__":
    main()
