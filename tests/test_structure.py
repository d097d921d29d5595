"""The package's dependencies point one way (docs/architecture.md):

    errors <- plan <- models, testing <- costmodel, transport <- sender, receiver <- adapters
    <- integrations <- tools

No module imports a package of a later layer or of another package in its
own layer, no import cycle exists between modules (imports inside functions
count; ``TYPE_CHECKING`` imports do not), no module imports another
module's private names, the engine adapters import each other only through
``adapters.core``, the pure layers import no engine and no torch at
module level, and the RL framework integrations import no framework and no
engine at module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "reshard"

ENGINES = ("vllm", "sglang", "megatron")
"""Every engine (or trainer framework) an adapter serves, by its import name:
``reshard/adapters/<name>``, imported lazily (docs/architecture.md: a new
engine adds its name here)."""
FRAMEWORKS = ("trl", "verl", "openrlhf")
"""Every RL framework with a drop-in, by its import name: ``reshard/integrations/<name>.py``."""

LAYERS = {
    "errors": 0,
    "plan": 1,
    "models": 2,
    "testing": 2,
    "costmodel": 3,
    "transport": 3,
    "sender": 4,
    "receiver": 4,
    "adapters": 5,
    "integrations": 6,
    "tools": 7,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """``(module, names, at module level)`` of every reshard import, TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, list[str], bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub, top)
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.append((child.module, [a.name for a in child.names], top))
            elif isinstance(child, ast.Import):
                out.extend((a.name, [], top) for a in child.names)
            inner = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            visit(child, inner)

    visit(tree, True)
    return out


def _target(module: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """The reshard modules an import reaches (``from pkg import submodule`` counts the submodule)."""
    if module not in modules:
        return []
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
    return subs if subs and len(subs) == len(names) else [module]


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_an_init():
    """A folder of modules without ``__init__.py`` is a namespace package,
    which ``_modules`` does not list: every ``from reshard.pkg import x``
    would then be invisible to the checks below."""
    missing = [
        str(d.relative_to(ROOT.parent))
        for d in sorted({p.parent for p in ROOT.rglob("*.py")})
        if "__pycache__" not in d.parts and not (d / "__init__.py").exists()
    ]
    assert not missing, f"packages without __init__.py: {missing}"


def test_every_import_of_a_reshard_module_is_resolved():
    """Each ``import``/``from ... import`` naming a reshard module reaches a
    module the checks know (a typo or a hole would let an import pass unseen)."""
    modules = _modules()
    bad = []
    for mod, path in modules.items():
        for imported, names, _top in _imports(path):
            if imported.split(".")[0] == "reshard" and not _target(imported, names, modules):
                bad.append(f"{mod} imports {imported}")
    assert not bad, "\n".join(bad)


def test_layers_point_one_way():
    modules = _modules()
    bad = []
    for mod, path in modules.items():
        pkg = _package(mod)
        if pkg not in LAYERS:
            continue  # the root's public surface
        for imported, names, _top in _imports(path):
            for target in _target(imported, names, modules):
                tpkg = _package(target)
                if not tpkg or tpkg == pkg:
                    continue
                if tpkg not in LAYERS:
                    bad.append(f"{mod} imports {target}, which is not in a layer")
                elif LAYERS[tpkg] >= LAYERS[pkg]:
                    bad.append(f"{mod} (layer {LAYERS[pkg]}) imports {target} (layer {LAYERS[tpkg]})")
    assert not bad, "\n".join(bad)


def test_engine_adapters_share_only_the_core():
    modules = _modules()
    bad = []
    for mod, path in modules.items():
        parts = mod.split(".")
        if len(parts) < 3 or parts[1] != "adapters":
            continue
        mine = parts[2]
        for imported, names, _top in _imports(path):
            for target in _target(imported, names, modules):
                tparts = target.split(".")
                if len(tparts) >= 3 and tparts[1] == "adapters" and tparts[2] not in (mine, "core"):
                    bad.append(f"{mod} imports {target}")
                if mine == "core" and len(tparts) >= 3 and tparts[1] == "adapters" and tparts[2] != "core":
                    bad.append(f"the adapters' core {mod} imports {target}")
    assert not bad, "\n".join(bad)


def test_no_module_imports_private_names_of_another():
    modules = _modules()
    bad = []
    for mod, path in modules.items():
        for imported, names, _top in _imports(path):
            if imported in modules and imported != mod:
                bad += [f"{mod} imports {imported}.{n}" for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_modules():
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        deps = set()
        for imported, names, _top in _imports(path):
            deps.update(t for t in _target(imported, names, modules) if t != mod)
        # A package's __init__ re-exporting its submodules is not a cycle.
        graph[mod] = {d for d in deps if not mod.startswith(d + ".") and not d.startswith(mod + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d) :], d]))
            elif d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    assert not cycles, "\n".join(cycles)


def test_the_pure_layers_import_no_engine_and_no_torch_at_module_level():
    modules = _modules()
    heavy = ("torch", "transformers", "ray", *ENGINES)
    bad = []
    for mod, path in modules.items():
        if _package(mod) not in ("errors", "plan", "models", "costmodel", "transport", "sender", "receiver"):
            continue
        for imported, _names, top in _imports(path):
            if top and imported.split(".")[0] in heavy:
                bad.append(f"{mod} imports {imported} at module level")
    assert not bad, "\n".join(bad)


def test_the_integrations_import_no_framework_and_no_engine_at_module_level():
    """``import reshard.integrations.<framework>`` works without the framework."""
    modules = _modules()
    heavy = ("torch", "transformers", "ray", "accelerate", "deepspeed", *ENGINES, *FRAMEWORKS)
    bad = []
    for mod, path in modules.items():
        if _package(mod) != "integrations":
            continue
        for imported, _names, top in _imports(path):
            if top and imported.split(".")[0] in heavy:
                bad.append(f"{mod} imports {imported} at module level")
            if top and imported in modules and _package(imported) == "adapters":
                # Adapter modules imported at module level must be light too.
                for sub, _n, sub_top in _imports(modules[imported]):
                    if sub_top and sub.split(".")[0] in heavy:
                        bad.append(f"{mod} imports {imported}, which imports {sub} at module level")
    assert not bad, "\n".join(bad)


# -- the recipes of docs/architecture.md -------------------------------------------------

_DOC_ROOTS = ("tests/", "docs/", "scripts/", "requirements/", "benchmarks/", "examples/")
_ROOT_FILES = ("pyproject.toml", "Makefile", "README.md")


def _recipe_paths() -> list[str]:
    """The paths named by "Where each kind of change goes" (docs/architecture.md)."""
    import re

    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = doc.split("## Where each kind of change goes", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    out = []
    for token in re.findall(r"`([^`]+)`", table):
        if "<name>" in token or " " in token:
            continue
        if token in _ROOT_FILES or token.endswith((".py", ".md", ".toml", ".sh", ".txt")) or token.endswith("/"):
            out.append(token)
    return out


def test_every_file_the_recipes_name_exists():
    """A recipe that names a file that moved sends a newcomer to the wrong room."""
    paths = _recipe_paths()
    assert len(paths) > 20, paths
    missing = []
    for p in paths:
        base = ROOT.parent if p.startswith(_DOC_ROOTS) or p in _ROOT_FILES else ROOT
        if not (base / p).exists():
            missing.append(p)
    assert missing == [], missing


def test_the_registries_the_recipes_name_hold_every_engine_and_framework():
    """A new engine's adapter, or a new framework's drop-in, is named in
    the lists the layering checks read (the recipes say so)."""
    adapters = {p.stem if p.is_file() else p.name for p in (ROOT / "adapters").iterdir()}
    adapters -= {"core", "__init__", "__pycache__"}
    assert adapters == set(ENGINES)
    drop_ins = {p.stem for p in (ROOT / "integrations").glob("*.py")} - {"__init__", "framework", "verl_backend"}
    assert drop_ins == set(FRAMEWORKS)
