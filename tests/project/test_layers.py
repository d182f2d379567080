"""The package's layers, read from its import statements (lazy and type-only imports included).

- the package's parts (its folders and top-level modules) form the ordered layers of
  ``LAYERS``, which the docs' architecture page lists: a part imports only parts of lower
  layers, so no import points up and no cycle joins two parts;
- no import cycle between modules;
- ``radixserve.kernels`` (the Triton kernels) depends on nothing else in the package;
- ``distributed`` sits below ``model`` (it never imports the model, attention, cache or
  scheduler);
- the runtime client layer (``runtime``) and the offline ``Engine`` never import the HTTP
  layer (``frontend``);
- no package file imports the checkout's ``bench/`` folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"radixserve": ROOT / "radixserve", "radixserve.kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([prefix, *parts])] = path
    return mods


MODULES = _modules()


def _absolute(module: str | None, level: int, importer: str, is_package: bool) -> str:
    if not level:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str) -> dict[str, int]:
    """The package modules ``name`` imports, each with the line of its first import.
    ``from pkg import sub`` where ``sub`` is a module counts as importing ``sub`` only."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, name, path.name == "__init__.py")
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        for target in targets:
            if target in MODULES and target != name:
                found.setdefault(target, node.lineno)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _crossings(frm: str, to: tuple[str, ...]) -> list[str]:
    return [f"{MODULES[a].relative_to(ROOT)}:{line} imports {b}"
            for a, deps in sorted(GRAPH.items()) if _in(a, frm)
            for b, line in sorted(deps.items()) if any(_in(b, t) for t in to)]


# The package's parts, top to bottom: a part imports only parts of the layers below its own.
# docs/architecture.md lists the same layers (test_the_docs_list_the_layers).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("program",),
    ("engine", "frontend"),
    ("runtime",),
    ("disagg",),
    ("scheduler", "detokenizer"),
    ("speculative", "executor"),
    ("model",),
    ("attention", "distributed", "lora"),
    ("quantization", "batch"),
    ("cache", "ipc", "chat", "grammar", "tokenizer"),
    ("schema",),
    ("sampling",),
    ("cpu_ext", "kernels", "transfer"),
    ("config",),
    ("hardware", "settings"),
    ("checkpoint", "validation", "logging_utils", "threads", "profiler_scopes"),
)


def part_of(module: str) -> str | None:
    """The part a module belongs to: ``radixserve.cache.radix_tree`` -> ``cache``; None for the
    package itself (``from radixserve import __version__``), which every import runs anyway."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return parts[1]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a part from a part of the same or a higher layer, and every part that
    ``LAYERS`` does not place."""
    level = {part: i for i, names in enumerate(LAYERS) for part in names}
    found = []
    for a, deps in sorted(graph.items()):
        pa = part_of(a)
        if pa is None:
            continue
        if pa not in level:
            found.append(f"{a}: part {pa!r} is in no layer of LAYERS")
            continue
        for b, line in sorted(deps.items()):
            pb = part_of(b)
            if pb is None or pb == pa:
                continue
            if pb not in level or level[pb] <= level[pa]:
                found.append(f"{a}:{line} imports {b} ({pa} -> {pb}: not a lower layer)")
    return found


def test_parts_import_only_lower_layers():
    assert upward_imports(GRAPH) == []


def test_an_upward_import_is_caught():
    graph = {name: dict(deps) for name, deps in GRAPH.items()}
    graph["radixserve.config"]["radixserve.scheduler.scheduler"] = 1
    graph["radixserve.cache.kv_pool"]["radixserve.ipc.messages"] = 2  # same layer: refused too
    found = upward_imports(graph)
    assert any("radixserve.config:1 imports radixserve.scheduler.scheduler" in f for f in found)
    assert any("radixserve.cache.kv_pool:2 imports radixserve.ipc.messages" in f for f in found)


def test_every_part_is_placed_once():
    placed = [part for names in LAYERS for part in names]
    assert len(placed) == len(set(placed))
    assert {part_of(m) for m in MODULES} - {None} == set(placed)


def test_the_docs_list_the_layers():
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page.split("<!-- layers: tests/project/test_layers.py -->", 1)[1].split("```", 2)[1]
    rows = [line for line in block.splitlines() if line[:1].isdigit()]
    listed = tuple(tuple(line.split(".", 1)[1].split()) for line in rows)
    assert listed == LAYERS


def test_the_graph_sees_the_package():
    # the checks below are only as good as the graph: it must find the known edges
    assert len(MODULES) > 100
    assert "radixserve.config" in GRAPH["radixserve.engine"]
    assert "radixserve.kernels.common" in GRAPH["radixserve.kernels.decode_attention"]


def test_no_import_cycle():
    assert _cycles() == []


@pytest.mark.parametrize("frm, forbidden", [
    ("radixserve.kernels", ("radixserve.attention", "radixserve.batch", "radixserve.cache", "radixserve.model",
                            "radixserve.scheduler", "radixserve.config", "radixserve.distributed")),
    ("radixserve.distributed", ("radixserve.model", "radixserve.attention", "radixserve.cache",
                                "radixserve.scheduler", "radixserve.batch")),
    ("radixserve.runtime", ("radixserve.frontend",)),
    ("radixserve.engine", ("radixserve.frontend",)),
])
def test_layer_arrows(frm, forbidden):
    assert _crossings(frm, forbidden) == []


def test_kernels_depend_on_nothing_else_in_the_package():
    outside = [c for c in _crossings("radixserve.kernels", ("radixserve",)) if " radixserve.kernels" not in c]
    assert outside == []


def test_no_package_file_reaches_into_bench():
    offenders = []
    for path in MODULES.values():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                mods = [node.value] if node.value.startswith("bench.") else []
            if any(m == "bench" or m.startswith("bench.") for m in mods):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_front_end_starts_without_torch():
    """The HTTP process and the command line import no torch or transformers when they load:
    the server binds its port and starts the model processes while those import torch, and a
    request's validation needs neither (the tokenizer is loaded when the server starts)."""
    import subprocess
    import sys

    code = ("import sys, radixserve.cli, radixserve.frontend.server; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_no_package_file_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}


def test_no_package_line_over_100_characters():
    """The project's line length (ruff's, 100) in the package's Python and C++ sources, so the
    file cap counts lines of code rather than packed ones."""
    sources = [*MODULES.values(), *(ROOT / "radixserve" / "cpu_ext").glob("*.cpp"),
               *(ROOT / "radixserve" / "cpu_ext").glob("*.h")]
    long = [f"{path.relative_to(ROOT)}:{n}" for path in sources
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
    assert long == []


def test_no_function_over_80_lines_outside_the_kernels():
    long = []
    for name, path in MODULES.items():
        if _in(name, "radixserve.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_messages_carry_typed_fields():
    """What crosses a process boundary is typed down to its leaves: no field of a message or of
    a record inside one is ``Any`` (``dict[str, Any]`` included).  A control command's result,
    a JSON document served as it is (``/server_info``, ``/metrics``), is a ``JsonObject``:
    checked down to its leaves as JSON values."""
    import dataclasses
    import typing

    from radixserve.ipc import messages as m

    def untyped(tp: object) -> bool:
        if tp is typing.Any:
            return True
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            return any(untyped(hints[f.name]) for f in dataclasses.fields(tp))
        return any(untyped(a) for a in typing.get_args(tp))

    crossing = [*m._REGISTRY.values(), m.ModelInfo]  # ModelInfo: the scheduler's ready report
    found = [f"{cls.__name__}.{f.name}" for cls in crossing
             for f in dataclasses.fields(cls) if untyped(typing.get_type_hints(cls)[f.name])]
    assert found == []
