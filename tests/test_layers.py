"""The import graph is one-way: each package imports only the layers below it, and vLLM is
imported only under ``vllm_compaction/vllm/``. Checked on the source (every import statement,
at module level or inside a function), so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_compaction"
#: Lowest first; a module may import its own layer and the layers before it.
LAYERS = [
    {"am", "kernels", "text"},
    {"cache"},
    {"budgets"},
    {"models", "corpus"},
    {"queries", "summarize"},
    {"recipes"},
    {"pipeline", "reference", "eval"},
    {"sensitivity"},
    {"service"},
    {"vllm"},
    {"cli", "root"},
]


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "vllm_compaction_kernels":
        return "kernels"
    return parts[1] if len(parts) > 1 else "root"


def imports() -> list[tuple[str, str]]:
    """``(module, imported module)`` for every import of this package's modules."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(
            path.relative_to(PACKAGE.parent).with_suffix("").parts
        ).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(module, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((module, node.module))
    return out


def test_vllm_is_imported_only_under_the_vllm_package():
    offenders = [
        (m, n)
        for m, n in imports()
        if n.split(".")[0] == "vllm" and layer_of(m) != "vllm"
    ]
    assert not offenders, offenders


def test_no_module_imports_a_higher_layer():
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    offenders = []
    for module, imported in imports():
        if not imported.startswith(("vllm_compaction.", "vllm_compaction_kernels")):
            continue
        source, target = layer_of(module), layer_of(imported)
        assert source in rank and target in rank, (
            f"{module} or {imported} is in no layer: add it to LAYERS"
        )
        if rank[target] > rank[source]:
            offenders.append(f"{module} ({source}) imports {imported} ({target})")
    assert not offenders, "\n".join(offenders)
