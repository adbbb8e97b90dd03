"""Layering of core/petals, read from the source (every import statement, also inside functions).

The server never reaches into the client (what both need lives in ``petals.network``), the product
never imports the test kit ``petals.testing``, and ``petals.network`` stands below clients,
servers and the CLI.
"""

import ast
from pathlib import Path

import pytest

import petals
from petals.patches import parse_source

PACKAGE_DIR = Path(petals.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module an import statement anywhere in ``source`` names (``from a import b``: a and a.b)."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(parse_source(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def modules_under(subpackage: str = "") -> dict[str, set[str]]:
    """``{module name: the modules it imports}`` for every module of ``petals.<subpackage>``."""
    root = PACKAGE_DIR / subpackage.replace(".", "/")
    return {
        module_name(path): imported_modules(
            path.read_text(), module_name(path), is_package=path.name == "__init__.py"
        )
        for path in sorted(root.rglob("*.py"))
    }


def offenders(modules: dict[str, set[str]], forbidden: str) -> dict[str, list[str]]:
    found = {
        module: sorted(name for name in imports if name == forbidden or name.startswith(forbidden + "."))
        for module, imports in modules.items()
    }
    return {module: names for module, names in found.items() if names}


def test_the_scanner_sees_imports_inside_functions_and_relative_ones():
    source = "def ping():\n    from petals.client.rpc import ping\n\nfrom ..client import network\n"
    names = imported_modules(source, "petals.server.pings")
    assert {"petals.client.rpc", "petals.client", "petals.client.network"} <= names
    found = offenders({"petals.server.pings": names, "petals.server.quiet": {"petals.wire"}}, "petals.client")
    assert set(found) == {"petals.server.pings"}
    assert {"petals.client.network", "petals.client.rpc"} <= set(found["petals.server.pings"])


def test_the_server_does_not_import_the_client():
    server = modules_under("server")
    assert "petals.server.handler" in server and "petals.server.pings" in server
    assert offenders(server, "petals.client") == {}


def test_product_modules_do_not_import_the_test_kit():
    product = {
        module: imports
        for module, imports in modules_under().items()
        if module != "petals.testing" and not module.startswith("petals.testing.")
    }
    assert "petals.cli.demo" in product and "petals.local_swarm" in product
    assert offenders(product, "petals.testing") == {}


@pytest.mark.parametrize("above", ["petals.client", "petals.server", "petals.cli", "click"])
def test_the_network_layer_imports_nothing_above_it(above):
    network = modules_under("network")
    assert {"petals.network.p2p", "petals.network.client", "petals.network.rpc"} <= set(network)
    assert offenders(network, above) == {}


ENGINE_MODULES = (
    "petals.server.engine",
    "petals.server.scheduler",
    "petals.server.sessions",
    "petals.server.validation",
    "petals.server.cache_budget",
    "petals.server.backend",
    "petals.kv_cache",
)


@pytest.mark.parametrize("transport", ["hivemind", "petals.server.handler", "petals.network"])
def test_the_serving_engine_knows_no_transport(transport):
    engine = {module: imports for module, imports in modules_under().items() if module in ENGINE_MODULES}
    assert set(engine) == set(ENGINE_MODULES)
    assert offenders(engine, transport) == {}


def import_cycles(modules: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import each other, directly or around a circle (Tarjan's strongly
    connected components of more than one module)."""
    graph = {module: {name for name in imports if name in modules} for module, imports in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = set()
            while not group or module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                cycles.append(group)

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def test_the_scanner_finds_a_circle_of_imports():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


WEIGHT_LOADING = (
    "petals.auto",
    "petals.checkpoint",
    "petals.loading",
    "petals.wrappers",
    "petals.formats",
    "petals.convert",
)


def test_reading_weights_imports_in_one_direction():
    """Config, checkpoint, formats, loading and conversion import one another without a circle (the old
    auto -> loading -> gguf_checkpoint -> checkpoint_formats -> wrappers one included)."""
    involved = [
        cycle
        for cycle in import_cycles(modules_under())
        if any(module == name or module.startswith(name + ".") for module in cycle for name in WEIGHT_LOADING)
    ]
    assert involved == []
