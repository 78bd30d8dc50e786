"""The arrows of docs/architecture.md, read from the imports: a component imports only the
components below it, so `mqtt_proxy` stays replaceable and `store` stays usable alone (Spark,
tools). Fails naming the file, line and import that points up."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# component -> what it may import (of ours); the wiring in lightgate/ may import everything
ALLOWED: dict[str, set[str]] = {
    "store": set(),
    "notify": set(),
    "lightqueue": {"store"},
    "mqtt_proxy": {"notify", "lightqueue", "store"},
    "spark_analytics": {"store"},
    "lightgate": {"store", "lightqueue", "notify", "mqtt_proxy", "spark_analytics"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_no_arrow_points_up() -> None:
    wrong = []
    for pkg, may in ALLOWED.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for line, module in _imports(path):
                top = module.split(".")[0]
                if top in ALLOWED and top != pkg and top not in may:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "imports against the arrows of docs/architecture.md:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: an import of mqtt_proxy from store is found."""
    f = tmp_path / "bad.py"
    f.write_text("import os\nfrom mqtt_proxy.codec import x\nimport lightqueue.db\n")
    tops = [m.split(".")[0] for _, m in _imports(f)]
    assert [t for t in tops if t in ALLOWED and t not in ALLOWED["store"]] == [
        "mqtt_proxy",
        "lightqueue",
    ]


# Inside mqtt_proxy: the pull side, the session registry and data, inbound batching and the
# rights name a connection through ports.PeerPort / ports.ClientPort, so they stay out of the
# connection -> handlers -> connect_handler import cycle.
BELOW_THE_CONNECTION = {
    "mqtt_proxy/ports.py",
    "mqtt_proxy/access.py",
    "mqtt_proxy/context.py",
    "mqtt_proxy/connection/inbound.py",
    "mqtt_proxy/delivery/delivery.py",
    "mqtt_proxy/delivery/cohorts.py",
    "mqtt_proxy/delivery/shared_groups.py",
    "mqtt_proxy/delivery/queue_cache.py",
    "mqtt_proxy/sessions/state.py",
    "mqtt_proxy/sessions/manager.py",
    "mqtt_proxy/backends/backend.py",
}
ABOVE = {
    "mqtt_proxy.connection.connection",
    "mqtt_proxy.connection.handlers",
    "mqtt_proxy.connection.connect_handler",
    "mqtt_proxy.server",
}


def test_delivery_and_session_type_the_connection_through_ports() -> None:
    wrong = [
        f"{rel}:{line} imports {module}"
        for rel in sorted(BELOW_THE_CONNECTION)
        for line, module in _imports(ROOT / rel)
        if module in ABOVE
    ]
    assert not wrong, "use mqtt_proxy.ports instead:\n" + "\n".join(wrong)


# The core link's layers (docs/architecture.md, "The core link"): bodies pure, transport blind.
LINK_BODIES = ("store/wire.py", "lightqueue/wire.py", "notify/wire.py")
IO_MODULES = {"asyncio", "socket", "ssl", "selectors", "notify.link"}


def test_link_bodies_are_pure_and_the_transport_knows_no_method() -> None:
    wrong = []
    for rel in LINK_BODIES:
        for line, module in _imports(ROOT / rel):
            if module in IO_MODULES or module.split(".")[0] in IO_MODULES:
                wrong.append(f"{rel}:{line} imports {module} (a body module is sans-IO)")
    own = {"notify.link_auth", "notify.link_frames"}  # the transport's own sans-IO halves
    for rel in ("notify/link.py", "notify/link_frames.py", "notify/link_auth.py"):
        for line, module in _imports(ROOT / rel):
            if module.split(".")[0] in ALLOWED and module not in own:
                wrong.append(f"{rel}:{line} imports {module} (the transport knows no method)")
    for rel in ("notify/link_frames.py", "notify/link_auth.py"):
        for line, module in _imports(ROOT / rel):
            if module in IO_MODULES or module.split(".")[0] in IO_MODULES:
                wrong.append(f"{rel}:{line} imports {module} (framing and handshake are sans-IO)")
    assert not wrong, "\n".join(wrong)


# Inside mqtt_proxy, by room (docs/architecture.md, "`mqtt_proxy` (the MQTT server), by role"):
# what a lower room may not name. Counted with the imports under TYPE_CHECKING.
ROOM_MAY_NOT_IMPORT: dict[str, set[str]] = {
    # the sans-IO codec knows nothing of the server around it
    "codec": {"connection", "sessions", "delivery", "backends", "bridge", "server", "ports",
              "settings", "sys_topics", "device_events"},
    # delivery writes to connections through ports.PeerPort, reads through ports.QueuesPort
    "delivery": {"connection", "backends", "bridge", "server", "sys_topics", "device_events",
                 "sessions.manager"},
    # the layers below are reached only through ports; lightgate/ builds and hands them in
    "backends": {"connection", "delivery", "bridge", "sessions.manager", "sys_topics"},
    "sessions.state": {"connection", "delivery", "backends", "bridge", "server",
                       "sessions.manager"},
    "sessions.topic_filters": {"connection", "delivery", "backends", "bridge", "server", "ports",
                               "sessions.state", "sessions.manager"},
    "bridge": {"connection", "sessions", "delivery", "backends", "server", "sys_topics"},
    # the leaf every room types its neighbours with
    "ports": {"connection", "backends", "bridge", "server", "sessions.manager", "delivery.delivery",
              "sys_topics"},
    # the connection layer names no concrete backend (it gets the server's, typed by ports)
    "connection": {"backends", "bridge", "server"},
    # the session registry, the rights and the context are handed their collaborators
    "sessions": {"connection.connection", "connection.handlers", "connection.connect_handler",
                 "server"},
    "access": {"connection", "delivery", "backends", "bridge", "server", "sessions.manager"},
    "context": {"server", "connection.connection", "connection.handlers",
                "connection.connect_handler"},
    "sys_topics": {"server", "connection", "backends", "bridge"},
    "device_events": {"server", "connection", "sessions", "delivery", "backends", "bridge"},
    "messages": {"server", "connection", "sessions", "delivery", "backends", "bridge"},
}  # fmt: skip
# Below server.py nothing names the server: each room is handed what it uses (context.py, or
# narrow constructor arguments), not the server as a locator of everything.
UPPER_NAMES = {"mqtt_proxy.server": ("MqttServer",)}
# Nothing in mqtt_proxy outside backends/ names a concrete backend: lightgate/ chooses it.


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _within(module: str, room: str) -> bool:
    full = "mqtt_proxy." + room
    return module == full or module.startswith(full + ".")


def _own_imports(pkg: str) -> dict[str, set[str]]:
    """Module -> the modules of `pkg` it imports, TYPE_CHECKING imports included; `from a import
    b` names the module a.b when there is one (else a)."""
    paths = {_module_name(p): p for p in sorted((ROOT / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                out.update(s for s in subs if s in paths)
                if node.module in paths and any(s not in paths for s in subs):
                    out.add(node.module)
        out.discard(name)
        graph[name] = out
    return graph


def test_lower_rooms_of_the_proxy_do_not_name_the_upper_ones() -> None:
    graph = _own_imports("mqtt_proxy")
    wrong = []
    for module, imported in sorted(graph.items()):
        for room, banned in ROOM_MAY_NOT_IMPORT.items():
            if not _within(module, room):
                continue
            for target in sorted(imported):
                if any(_within(target, b) for b in banned) and not _within(target, room):
                    wrong.append(f"{module} imports {target} ({room} may not name it)")
        if not _within(module, "backends"):
            wrong += [f"{module} imports {t} (a concrete backend)" for t in sorted(imported)
                      if _within(t, "backends")]  # fmt: skip
    for path in sorted((ROOT / "mqtt_proxy").rglob("*.py")):
        module = _module_name(path)
        if module in UPPER_NAMES:
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.name.split(".")[-1] for n in ast.walk(tree)
                  if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}  # fmt: skip
        for upper, banned_names in UPPER_NAMES.items():
            for name in banned_names:
                if name in names:
                    wrong.append(f"{module} names {name} (of {upper}: hand it what it uses)")
    assert not wrong, "\n".join(wrong)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: import graphs can be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


# The largest circle of imports allowed in a package: mqtt_proxy's is the connection and its
# handlers (connection.py, handlers.py, connect_handler.py: the handlers take the connection they
# act on, which dispatches to them); lightqueue's the queues and their backfill and maintenance;
# lightgate's the app, its health and metrics pages.
MAX_IMPORT_CYCLE = 3


def test_no_package_has_a_large_import_cycle() -> None:
    """A cycle makes its modules one unit: none can be read, tested or moved alone. Typing a
    parameter with a narrow Protocol of mqtt_proxy/ports.py instead of importing the concrete
    class (even under TYPE_CHECKING) keeps a lower module out of the circle."""
    wrong = []
    for pkg in ALLOWED:
        for comp in strongly_connected(_own_imports(pkg)):
            if len(comp) > MAX_IMPORT_CYCLE:
                wrong.append(f"{pkg}: a cycle of {len(comp)} modules: {', '.join(comp)}")
    assert not wrong, "\n".join(wrong)


def test_the_cycle_check_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    comps = sorted(strongly_connected(graph), key=len)
    assert comps[-1] == ["a", "b", "c"] and len(comps) == 3
