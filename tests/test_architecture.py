"""The module map holds: no import cycles, protobuf only at the wire, the store without the
client package or mlx, the gateway without mlx or the engine, no private names across modules
(docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "engine_service": ROOT / "engine_service",
    "store_service": ROOT / "store_service",
    "tandem_wire": ROOT / "tandem_wire",
    "tandem_client": ROOT / "clients" / "python" / "tandem_client",
    # A proxy of engine messages: protobuf is its domain, so PB_ALLOWED leaves it out.
    "gateway_service": ROOT / "gateway_service",
}
# The only modules that may import generated protobuf code, per package.
PB_ALLOWED = {
    "engine_service": {
        "engine_service.front.wire",
        "engine_service.front.servicer",
        "engine_service.front.server",
    },
    "store_service": {
        "store_service.wire",
        "store_service.records",
        "store_service.servicer",
        "store_service.server",
    },
}


def _modules() -> dict[str, ast.Module]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if "pb" in path.relative_to(folder).parts:
                continue  # generated
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = ast.parse(path.read_text(), str(path))
    return found


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module, names) per import statement, at any depth (lazy imports count too)."""
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def test_no_import_cycles() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for module, names in _imports(tree):
            for target in (module, *(f"{module}.{n}" for n in names)):
                if target in modules and target != name:
                    graph[name].add(target)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_protobuf_stays_at_the_wire() -> None:
    for name, tree in _modules().items():
        package = name.split(".")[0]
        if package not in PB_ALLOWED or name in PB_ALLOWED[package]:
            continue
        for module, names in _imports(tree):
            uses_pb = module.startswith("tandem_wire.pb") or any(n.endswith("_pb2") for n in names)
            assert not uses_pb, f"{name} imports generated protobuf code ({module})"


def test_the_store_needs_neither_mlx_nor_the_client_package() -> None:
    for name, tree in _modules().items():
        if not name.startswith(("store_service", "tandem_wire")):
            continue
        for module, _ in _imports(tree):
            top = module.split(".")[0]
            assert top not in ("mlx", "mlx_lm", "tandem_client", "engine_service"), (name, module)


def test_the_gateway_needs_neither_mlx_nor_the_engine() -> None:
    for name, tree in _modules().items():
        if not name.startswith("gateway_service"):
            continue
        for module, _ in _imports(tree):
            top = module.split(".")[0]
            assert top not in ("mlx", "mlx_lm", "engine_service", "store_service"), (name, module)


def test_no_private_names_across_modules() -> None:
    modules = _modules()
    for name, tree in modules.items():
        for module, names in _imports(tree):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            if module.split(".")[0] in PACKAGES:
                assert not private, f"{name} imports private {private} from {module}"
            elif module.startswith("mlx_lm") and private:
                # mlx-lm privates go through the one adapter pinned to its version.
                assert name == "engine_service.model.mlx_compat", f"{name} imports {private}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in ("cache_lib", "mlx_lm", "generate")
            ):
                assert name == "engine_service.model.mlx_compat", f"{name} uses {node.attr}"
