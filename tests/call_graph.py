"""The call graph of rebm's code, read with `ast`, for the `_all_ranks` rule (docs/design.md §3,
"Collectives in plain sight"; tests/test_all_ranks_rule.py checks it).

A node is a function or method by its qualified name (`rebm.checkpoint.run_directory.resolve_run_dir`,
`rebm.eval.evaluator.Evaluator.evaluate_all_ranks`, a nested def as `outer.inner`). Its edges are
the calls the code names: a bare name (a def of an enclosing function, of the module, or an
import), `module.func` and `module.Class(...)`, `Class.method`, `self.method` / `cls.method` /
`super().method` (the class and its bases in rebm), and `Class(...)` (its `__init__` and
`__post_init__`). A call through anything else (a parameter, an attribute, a callback) has no edge:
the run-time check (tests/collective_guard.py) covers those. A call to a torch.distributed
collective, or a DistributedDataParallel construction, is an edge to the collective itself."""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

from tests.collective_guard import COLLECTIVES, SUFFIX

# DistributedDataParallel's construction verifies and broadcasts the parameters across ranks.
DDP_NAMES = frozenset({"torch.nn.parallel.DistributedDataParallel",
                       "torch.nn.parallel.distributed.DistributedDataParallel"})
ANY = "<any>."  # a call on an object the graph cannot type, whose name ends in SUFFIX


@dataclass
class Function:
    name: str                  # qualified: module.Class.method, module.outer.inner
    module: str
    path: Path
    line: int
    node: ast.AST
    cls: Optional[str] = None  # the qualified name of its class, for self./cls./super()
    scopes: Tuple[Dict[str, str], ...] = ()  # enclosing functions' nested defs, innermost first
    calls: Set[str] = field(default_factory=set)

    @property
    def short(self) -> str:
        return self.name[len(self.module) + 1:]


class Module:
    def __init__(self, name: str, path: Path, tree: ast.Module):
        self.name, self.path, self.tree = name, path, tree
        self.names: Dict[str, str] = {}  # bare name -> qualified target (def, class or import)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.names[node.name] = f"{name}.{node.name}"
        for node in ast.walk(tree):  # imports inside functions too (imported on use)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.names[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        self.names[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.names.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")


class CallGraph:
    def __init__(self, root: Path, folders: Tuple[str, ...] = ("rebm",)):
        self.root = root
        self.modules: Dict[str, Module] = {}
        self.functions: Dict[str, Function] = {}
        self.classes: Dict[str, List[str]] = {}  # qualified class -> qualified bases
        for path in sorted(p for folder in folders for p in (root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            module = Module(name, path, ast.parse(path.read_text(), str(path)))
            self.modules[name] = module
        for module in self.modules.values():
            self._collect(module, module.tree.body, module.name, None, ())
        for function in self.functions.values():
            function.calls = set(self._calls(function))

    def _collect(self, module: Module, body: list, prefix: str, cls: Optional[str],
                 scopes: Tuple[Dict[str, str], ...]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                qualified = f"{prefix}.{node.name}"
                self.classes[qualified] = [b for b in (self._dotted(module, base, scopes)
                                                       for base in node.bases) if b]
                self._collect(module, node.body, qualified, qualified, scopes)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualified = f"{prefix}.{node.name}"
                self.functions[qualified] = Function(qualified, module.name, module.path,
                                                     node.lineno, node, cls, scopes)
                inner = [n for n in _own_nodes(node, include_defs=True)
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
                nested = {n.name: f"{qualified}.{n.name}" for n in inner}
                self._collect(module, inner, qualified, cls, (nested, *scopes))

    def _dotted(self, module: Module, node: ast.AST, scopes=()) -> Optional[str]:
        """The qualified name an expression `a`, `a.b`, `a.b.c` refers to, or None."""
        if isinstance(node, ast.Name):
            for scope in scopes:
                if node.id in scope:
                    return scope[node.id]
            return module.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._dotted(module, node.value, scopes)
            return f"{base}.{node.attr}" if base else None
        return None

    def _method(self, cls: str, name: str, seen: Optional[Set[str]] = None) -> Optional[str]:
        """`name` as `cls` has it: its own, or its first base's in rebm that has it."""
        seen = seen or set()
        if cls in seen:
            return None
        seen.add(cls)
        if f"{cls}.{name}" in self.functions:
            return f"{cls}.{name}"
        for base in self.classes.get(cls, []):
            found = self._method(self._canonical(base), name, seen)
            if found:
                return found
        return None

    def _canonical(self, name: str) -> str:
        """A dotted name (`rebm.distributed.decide_on_main`, `rebm.x.Class.method`) as the
        function, class or module it refers to, through the imports that re-export it."""
        for _ in range(8):
            if name in self.functions or name in self.classes or name in self.modules:
                return name
            parts = name.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                module = self.modules.get(".".join(parts[:cut]))
                if module is not None:
                    break
            else:
                return name
            head, rest = module.names.get(parts[cut]), parts[cut + 1:]
            if head is None or head == ".".join(parts[:cut + 1]) and not rest:
                return name
            head = self._canonical(head)
            if rest and head in self.classes and len(rest) == 1:
                return self._method(head, rest[0]) or name
            name = ".".join([head, *rest])
        return name

    def _targets(self, function: Function, call: ast.Call) -> Iterator[str]:
        module = self.modules[function.module]
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and func.value.id in ("self", "cls") and function.cls:
            found = self._method(function.cls, func.attr)
            if found:
                yield found
            return
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) \
                and isinstance(func.value.func, ast.Name) and func.value.func.id == "super" \
                and function.cls:
            for base in self.classes.get(function.cls, []):
                found = self._method(self._canonical(base), func.attr)
                if found:
                    yield found
                    return
            return
        dotted = self._dotted(module, func, function.scopes)
        if dotted is None:
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.endswith(SUFFIX):  # a method of an object: its name says it is collective
                yield f"{ANY}{name}"
            return
        if dotted.startswith("torch.distributed.") and dotted.rpartition(".")[2] in COLLECTIVES \
                or dotted in DDP_NAMES:
            yield dotted
            return
        target = self._canonical(dotted)
        if target in self.functions:
            yield target
        elif target in self.classes:
            for hook in ("__init__", "__post_init__"):
                found = self._method(target, hook)
                if found:
                    yield found

    def _calls(self, function: Function) -> Iterator[str]:
        for node in _own_nodes(function.node):
            if isinstance(node, ast.Call):
                yield from self._targets(function, node)

    def reaching(self, stops: Set[str]) -> Dict[str, List[str]]:
        """Every function that reaches a collective, with one shortest path to it (the function
        first, the collective last). A function in `stops` reaches, but its callers do not
        reach through it (the entry points: every rank runs them from the start)."""
        callers: Dict[str, Set[str]] = {}
        for function in self.functions.values():
            for callee in function.calls:
                callers.setdefault(callee, set()).add(function.name)
        sources = {c for f in self.functions.values() for c in f.calls
                   if c not in self.functions}
        path: Dict[str, List[str]] = {source: [source] for source in sources}
        queue = deque(sorted(sources))
        while queue:
            callee = queue.popleft()
            if callee in stops:
                continue
            for caller in sorted(callers.get(callee, ())):
                if caller not in path:
                    path[caller] = [caller, *path[callee]]
                    queue.append(caller)
        return {name: trail for name, trail in path.items() if name in self.functions}


def _directly_in(outer: ast.AST, node: ast.AST) -> bool:
    """`node` is a def nested in `outer` with no def in between (inside ifs, withs, loops)."""
    return any(n is node for n in _own_nodes(outer, include_defs=True))


def _own_nodes(node: ast.AST, include_defs: bool = False) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of the functions and classes nested in it
    (their own nodes in the graph); lambdas and comprehensions are the function's own."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if include_defs:
                yield child
            for decorator in getattr(child, "decorator_list", []):
                stack.append(decorator)
            continue
        yield child
        stack.extend(ast.iter_child_nodes(child))
