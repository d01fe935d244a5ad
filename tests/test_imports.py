"""The package's modules import one another without a circle, counting imports under TYPE_CHECKING: a type
hint that needs a higher module is a back-reference all the same.

Its sub-packages (and top-level modules) form a stack, each importing only what lies below it. Bottom to top:
errors, distributed, quantization, kernels, blocks, attention (the attention math and the keyword contract),
layers, eviction, config, layer_types, accounting, paged_attention (the function transformers calls), cache_step,
forks, persistence, cache_blocks (the narrow face of a cache's blocks), cache, memory, inspection, serving, then the
leaves (scoring, smollm2, capacity, demo).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_paged_cache
import hf_paged_cache.kernels

PACKAGE = Path(hf_paged_cache.__file__).parent
KERNELS = Path(hf_paged_cache.kernels.__file__).parent
LAYERS = ["errors", "distributed", "quantization", "kernels", "blocks", "attention", "layers", "read_paths", "eviction", "config",
          "layer_types", "sequence_state", "accounting", "paged_attention", "cache_step", "forks", "persistence",
          "cache_blocks", "cache", "memory", "inspection", "forwards", "cpu_runtime", "serving", "scoring", "smollm2", "capacity", "demo"]  # fmt: skip


def _modules() -> dict[str, Path]:
    """Every module of the package, the kernels (installed as `hf_paged_cache.kernels`) among them."""
    modules = {}
    for root, prefix in ((PACKAGE, ("hf_paged_cache",)), (KERNELS, ("hf_paged_cache", "kernels"))):
        for path in root.rglob("*.py"):
            parts = (*prefix, *path.relative_to(root).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that `module` imports (relative or absolute, at any depth of the file)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {name for name in candidates if name in modules and name not in (module, "hf_paged_cache")}
    return found


def test_the_import_graph_walk_sees_type_checking_imports():
    modules = _modules()
    assert "hf_paged_cache.blocks.plan" in _imports("hf_paged_cache.eviction.attention_stats",
                                                     modules["hf_paged_cache.eviction.attention_stats"], modules)


def test_no_module_imports_itself_through_a_circle():
    modules = _modules()
    graph = {module: _imports(module, path, modules) for module, path in modules.items()}
    circles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for target in graph[node]:
                if target == start:
                    circles.append(" -> ".join(trail + [start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, trail + [target]))
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles)))


def _unit(module: str) -> str:
    """The sub-package (or top-level module) a module belongs to."""
    return module.split(".")[1]


def _unit_imports() -> dict[str, dict[str, list[str]]]:
    """{unit: {unit it imports: the module imports that make the edge}}, between different units only."""
    modules = _modules()
    edges: dict[str, dict[str, list[str]]] = {}
    for module, path in modules.items():
        if module == "hf_paged_cache":
            continue
        for target in _imports(module, path, modules):
            if _unit(target) != _unit(module):
                edges.setdefault(_unit(module), {}).setdefault(_unit(target), []).append(f"{module} -> {target}")
    return edges


def test_the_sub_packages_form_a_stack():
    edges = _unit_imports()
    units = {_unit(module) for module in _modules() if module != "hf_paged_cache"}
    assert units <= set(LAYERS), f"place these in LAYERS (and the docstring): {sorted(units - set(LAYERS))}"
    upward = [line for unit, targets in edges.items() for target, lines in targets.items()
              if LAYERS.index(target) > LAYERS.index(unit) for line in lines]  # fmt: skip
    assert not upward, "imports of a package above the importer:\n" + "\n".join(sorted(upward))


def test_the_sub_package_graph_has_no_circle():
    edges = _unit_imports()
    state: dict[str, str] = {}

    def visit(unit: str, trail: list[str]) -> None:
        if state.get(unit) == "done":
            return
        assert state.get(unit) != "open", "sub-package circle: " + " -> ".join([*trail, unit])
        state[unit] = "open"
        for target in sorted(edges.get(unit, {})):
            visit(target, [*trail, unit])
        state[unit] = "done"

    for unit in sorted(edges):
        visit(unit, [])
