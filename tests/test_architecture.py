"""The module map holds: no import cycles, protobuf only at the wire, the store without the
client package or mlx, the gateway without mlx or the engine, no private names across modules
(docs/architecture.md)."""

from __future__ import annotations

import ast
import functools
import importlib.util
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
        "engine_service.front.wire_out",
        "engine_service.front.tool_wire",
        "engine_service.front.servicer",
        "engine_service.front.server",
    },
    "store_service": {
        "store_service.wire",
        "store_service.records",
        "store_service.put_spec",
        "store_service.servicer",
        "store_service.handlers",  # the servicer's method table, split out of it
        "store_service.same_host_gets",  # the servicer's same-host Gets: their answers
        "store_service.server",
    },
}


@functools.cache  # parsed once for every test here (none changes a tree)
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


# The one module that may touch mlx-lm's private names (pinned to mlx-lm's version)...
MLX_COMPAT = "engine_service.model.mlx_compat"
# ...and the BatchGenerator subclass that overrides its private `_next` (pinned the same way;
# tests/test_folded_prefill.py holds it to mlx-lm's own tokens): its attributes only.
MLX_GENERATOR = "engine_service.model.folded_prefill"


def _mlx_lm_private_names() -> set[str]:
    """The private attribute names mlx-lm itself defines, read off the installed sources:
    `self._x = ...` (or `cls._x`) in its methods, and `_x` methods and class attributes."""
    spec = importlib.util.find_spec("mlx_lm")
    assert spec is not None and spec.submodule_search_locations, "mlx-lm is not installed"
    names: set[str] = set()
    for folder in spec.submodule_search_locations:
        for path in Path(folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls")
                ):
                    names.add(node.attr)
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            names.add(item.name)
                        elif isinstance(item, ast.Assign):
                            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            names.add(item.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _mlx_lm_bindings(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(module aliases, class names) a module binds from mlx-lm; names taken from the adapter
    (mlx_compat re-exports mlx-lm's private base class) count as mlx-lm's."""
    modules: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mlx_lm":
                    modules.add(alias.asname or "mlx_lm")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] == "mlx_lm" or node.module == MLX_COMPAT:
                for alias in node.names:
                    bound = alias.asname or alias.name
                    # `from mlx_lm.models import cache as cache_lib` binds a module.
                    (modules if alias.name[:1].islower() else names).add(bound)
    return modules, names


def _mlx_lm_classes(modules: dict[str, ast.Module]) -> set[str]:
    """Our classes whose instances are mlx-lm objects: those deriving from an mlx-lm class
    (through our own classes too), and the mixins such a class is built from."""
    classes: list[tuple[ast.ClassDef, set[str], set[str]]] = []
    for name, tree in modules.items():
        if name.startswith("engine_service."):
            aliases, imported = _mlx_lm_bindings(tree)
            classes += [
                (n, aliases, imported) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
            ]
    ours = {node.name for node, _, _ in classes}
    marked: set[str] = set()
    while True:
        before = len(marked)
        for node, aliases, imported in classes:
            for base in node.bases:
                root = base
                while isinstance(root, ast.Attribute):
                    root = root.value
                if (isinstance(base, ast.Name) and (base.id in imported or base.id in marked)) or (
                    isinstance(base, ast.Attribute)
                    and isinstance(root, ast.Name)
                    and root.id in aliases
                ):
                    marked.add(node.name)
            if node.name in marked:  # its mixins are mlx-lm objects' classes too
                marked.update(b.id for b in node.bases if isinstance(b, ast.Name) and b.id in ours)
        if len(marked) == before:
            return marked


class _PrivateUses(ast.NodeVisitor):
    """`<expr>._x` where `_x` is one of mlx-lm's private names: on any receiver but `self` /
    `cls`, and on those inside a class whose instances are mlx-lm objects (where the name
    may be mlx-lm's: our own attributes there are named apart from mlx-lm's)."""

    def __init__(self, private: set[str], mlx_classes: set[str], aliases: set[str]) -> None:
        self.private, self.mlx_classes, self.aliases = private, mlx_classes, aliases
        self.classes: list[str] = []
        self.found: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:  # noqa: N802
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:  # noqa: N802
        attr, value = node.attr, node.value
        if attr.startswith("_") and not attr.startswith("__"):
            receiver = value.id if isinstance(value, ast.Name) else ""
            if receiver in self.aliases:  # a private of an mlx-lm module
                self.found.append(f"line {node.lineno}: {ast.unparse(node)}")
            elif attr in self.private and (
                receiver not in ("self", "cls")
                or (self.classes and self.classes[-1] in self.mlx_classes)
            ):
                self.found.append(f"line {node.lineno}: {ast.unparse(node)}")
        self.generic_visit(node)


def test_no_private_names_across_modules() -> None:
    modules = _modules()
    for name, tree in modules.items():
        for module, names in _imports(tree):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            if module.split(".")[0] in PACKAGES:
                assert not private, f"{name} imports private {private} from {module}"
            elif module.startswith("mlx_lm") and private:
                # mlx-lm privates go through the one adapter pinned to its version.
                assert name == MLX_COMPAT, f"{name} imports {private}"
    # Nor attributes: an mlx-lm private name read or written outside the adapter, on an mlx-lm
    # object or on one of our subclasses of mlx-lm classes, is a use of mlx-lm's internals.
    mlx_private = _mlx_lm_private_names()
    assert {"_idx", "_offset", "_tokenizer", "_temporal_order"} <= mlx_private
    mlx_classes = _mlx_lm_classes(modules)
    assert {"BatchQuantizedKVCache", "BatchState", "PlainRingRow"} <= mlx_classes
    for name, tree in modules.items():
        if not name.startswith("engine_service.") or name in (MLX_COMPAT, MLX_GENERATOR):
            continue
        uses = _PrivateUses(mlx_private, mlx_classes, _mlx_lm_bindings(tree)[0])
        uses.visit(tree)
        assert not uses.found, f"{name} uses mlx-lm's private names: {uses.found}"


# The engine's rooms (docs/architecture.md). The front process runs gRPC and never the batch:
# it imports the protocol, errors, config, BLAS set-up and the tokenizer view, nothing else.
FRONT_MAY_IMPORT = (
    "engine_service.front",
    "engine_service.protocol",
    "engine_service.errors",
    "engine_service.config",
    "engine_service.store_flags",  # config.py's store-link flags
    "engine_service.blas",
    "engine_service.transformers_import",
    "engine_service.model.loaded",
)
# The core's rooms never reach back into the front.
CORE_ROOMS = ("loop", "kv", "checkpoints", "speculative", "sampling", "model", "core")


def _engine_imports(tree: ast.Module) -> list[str]:
    out: list[str] = []
    for module, names in _imports(tree):
        if module == "engine_service":  # `from engine_service import blas`
            out.extend(f"engine_service.{n}" for n in names)
        elif module.startswith("engine_service."):
            out.append(module)
    return out


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_front_imports_only_the_protocol_and_the_tokenizer_view() -> None:
    for name, tree in _modules().items():
        if not _within(name, ("engine_service.front",)):
            continue
        for module in _engine_imports(tree):
            assert _within(module, FRONT_MAY_IMPORT), f"the front's {name} imports {module}"


def test_the_core_rooms_never_import_the_front() -> None:
    for name, tree in _modules().items():
        if not any(_within(name, (f"engine_service.{room}",)) for room in CORE_ROOMS):
            continue
        for module in _engine_imports(tree):
            assert not _within(module, ("engine_service.front",)), f"{name} imports {module}"


def test_the_protocol_imports_no_mlx_and_nothing_but_itself() -> None:
    for name, tree in _modules().items():
        if not _within(name, ("engine_service.protocol",)):
            continue
        for module, _ in _imports(tree):
            assert module.split(".")[0] not in ("mlx", "mlx_lm", "numpy"), (name, module)
        for module in _engine_imports(tree):
            allowed = ("engine_service.protocol", "engine_service.errors")
            assert _within(module, allowed), f"{name} imports {module}"


def test_importing_the_front_loads_no_batch_cache_loop_or_checkpoint_module() -> None:
    """The proof in docs/architecture.md, in a fresh interpreter: the front's servicer and
    server load the protocol and the tokenizer view, never mlx-lm's batch caches' users."""
    import subprocess
    import sys

    probe = (
        "import sys, engine_service.front.servicer, engine_service.front.server;"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('engine_service'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    assert "engine_service.front.servicer" in loaded and "engine_service.protocol.channel" in loaded
    for module in loaded:
        assert _within(module, (*FRONT_MAY_IMPORT, "engine_service.model")) or module in (
            "engine_service",
        ), f"importing the front loads {module}"
    rooms = {m.split(".")[1] for m in loaded if m.count(".") >= 1}
    assert not rooms & {"loop", "kv", "checkpoints", "speculative", "sampling", "core"}, rooms
