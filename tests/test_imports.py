"""The package's modules import one another without a circle, counting imports under TYPE_CHECKING: a type
hint that needs a higher module is a back-reference all the same."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_paged_cache

PACKAGE = Path(hf_paged_cache.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("hf_paged_cache", *path.relative_to(PACKAGE).with_suffix("").parts)
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
