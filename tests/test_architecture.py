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


# Inside mqtt_proxy: the pull side and the session data name a connection through ports.PeerPort,
# so they stay out of the connection -> handlers -> server -> sessions import cycle.
BELOW_THE_CONNECTION = {
    "mqtt_proxy/ports.py",
    "mqtt_proxy/delivery/delivery.py",
    "mqtt_proxy/delivery/cohorts.py",
    "mqtt_proxy/delivery/shared_groups.py",
    "mqtt_proxy/delivery/queue_cache.py",
    "mqtt_proxy/sessions/state.py",
    "mqtt_proxy/backends/backend.py",
}
ABOVE = {
    "mqtt_proxy.connection.connection",
    "mqtt_proxy.connection.handlers",
    "mqtt_proxy.connection.connect_handler",
    "mqtt_proxy.server",
    "mqtt_proxy.sessions.manager",
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
