"""No two packages of rebm import each other, directly or around a loop (docs/design.md §6).

The layers contract (pyproject.toml, tests/test_layout.py) orders the layers; this checks the
package graph itself: an edge A -> B when any module of rebm's top-level package (or module) A
imports one of B, from grimp, the import graph import-linter builds. Run as a script, it prints
the cycles: `python -m tests.test_package_cycles`.
"""

from __future__ import annotations

from typing import Dict, List, Set

import grimp


def package_graph(root: str = "rebm") -> Dict[str, Set[str]]:
    """{package: the packages it imports}, over the children of `root`."""
    graph = grimp.build_graph(root, cache_dir=None)
    packages = sorted(graph.find_children(root))
    return {a: {b for b in packages if b != a
                and graph.direct_import_exists(importer=a, imported=b, as_packages=True)}
            for a in packages}


def simple_cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Every elementary cycle, each once, starting at its smallest node."""
    nodes = sorted(edges)
    cycles = []
    for i, start in enumerate(nodes):
        allowed = set(nodes[i:])
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges[node]):
                if nxt == start:
                    cycles.append(path)
                elif nxt in allowed and nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return cycles


def _describe(cycle: List[str]) -> str:
    return " -> ".join(name.rpartition(".")[2] for name in cycle + cycle[:1])


def test_simple_cycles_finds_each_loop_once():
    edges = {"a": {"b"}, "b": {"a", "c"}, "c": {"a"}, "d": {"a"}}
    assert sorted(map(_describe, simple_cycles(edges))) == ["a -> b -> a", "a -> b -> c -> a"]


def test_no_package_imports_itself_around_a_loop():
    cycles = [_describe(c) for c in simple_cycles(package_graph())]
    assert not cycles, f"package cycles in rebm: {'; '.join(cycles)}"


if __name__ == "__main__":
    found = simple_cycles(package_graph())
    print(f"{len(found)} package cycles")
    for cycle in found:
        print(_describe(cycle))
