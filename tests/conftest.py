"""Shared fixtures, found by name (never imported by test files): `gateway` / `gateway_factory`
(a real `lightgate serve` process), `broker` / `embedded` (the MQTT gateway under test, see
mqtt_broker.py) and `spark` (one local SparkSession per test process, see spark_helpers.py); and
the modules that run against both implementations of the hot loops (compiled and pure Python)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_process import GatewayProcess
from mqtt_broker import InProcessBroker, ProcessBroker, serve_has_mqtt
from spark_helpers import JAVA_MISSING
from tansu import Tansu, start_tansu

# Test modules run against both implementations of the compiled hot loops (store/twins.py):
# in-process tests once with the compiled functions and once with every registered pure-Python
# twin switched in (`speedups_impl`); tests on the `broker` fixture gain a third gateway, "pure",
# started with LIGHTGATE_NO_EXTENSIONS=1 (next to "serve" and "split", which use the compiled
# modules).
BOTH_IMPLS = {
    "test_mqtt_codec_connection",
    "test_mqtt_codec_errors",
    "test_mqtt_codec_golden",
    "test_mqtt_codec_roundtrip",
    "test_mqtt_pubsub",
    "test_mqtt_clients",
    "test_lightqueue_dispatch",
    "test_store_record_batch",
}


# Scheduling (pytest-xdist, `--dist loadfile` in the Makefile): a test file runs on one worker,
# but a file parametrized over gateways (`broker`: serve / split / pure) is one unit per gateway,
# and the longest units are handed out first, so no worker is left with a long file at the end.
GATEWAY_PARAMS = {"serve", "split", "pure"}
LONGEST_FIRST = [  # the slowest files of a full run (make test prints the slowest tests)
    "test_bridge", "test_spark_notebook", "test_mqtt_replay", "test_spark_jobs", "test_mqtt_pubsub",
    "test_spark_docs", "test_mqtt_connect", "test_mqtt_sessions", "test_spark_source",
    "test_docs_snippets", "test_kafka_txn_delivery", "test_mqtt_clients",
]  # fmt: skip


def _unit(nodeid: str) -> str:
    """The scheduling unit of a test: its file, and its gateway where it has one."""
    path, _, rest = nodeid.partition("::")
    params = rest.partition("[")[2].rstrip("]").split("-")
    gateway = next((p for p in params if p in GATEWAY_PARAMS), "")
    return f"{path}[{gateway}]" if gateway else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GatewayFileScheduling(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return GatewayFileScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    last = len(rank)

    def key(item: pytest.Item) -> int:
        module = getattr(item, "module", None)
        return last if module is None else rank.get(module.__name__.rsplit(".", 1)[-1], last)

    items.sort(key=key)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.rsplit(".", 1)[-1] not in BOTH_IMPLS:
        return
    if "broker" in metafunc.fixturenames:
        # As a marker, so it replaces the fixture's own params instead of adding to them.
        mark = pytest.mark.parametrize("broker", ["serve", "split", "pure"], indirect=True)
        metafunc.definition.add_marker(mark)
    else:
        metafunc.parametrize("speedups_impl", ["compiled", "python"], indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def speedups_impl(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """In BOTH_IMPLS modules: "compiled" (fails when the extensions are missing on a machine
    that can build them) or "python" (the twins patched in); elsewhere None (as imported)."""
    impl = getattr(request, "param", None)
    if impl is None:
        yield None
        return
    from lightgate.twins_docs import import_all
    from store.twins import use_pure

    twins = import_all()  # every site has registered its pair
    if impl == "compiled":
        require_extensions()
        yield impl
        return
    with pytest.MonkeyPatch.context() as mp:
        # The fsync threads are switched per test by `fsync_impl`, not here.
        use_pure(mp.setattr, [t.key for t in twins if t.module != "store._fsync"])
        yield impl


@pytest.fixture(params=["compiled", "python"])
def fsync_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Group commit's fsync threads for stores opened in the test: "compiled"
    (store/_fsync.pyx) or "python" (store.commit.SyncWorkers' threads, which call os.fdatasync
    through store.commit: the fault injector)."""
    import store.commit  # noqa: F401 - registers the pair
    from store.twins import use_pure

    if request.param == "python":
        use_pure(monkeypatch.setattr, ["store._fsync.FsyncPool"])
    else:
        require_extensions()
    return str(request.param)


def require_extensions() -> None:
    """The compiled modules must be in use unless this machine cannot build them (no C
    compiler) or they are turned off: a build that silently fell back to Python fails here."""
    from store.speedups import DISABLED, status

    if DISABLED:
        pytest.skip("LIGHTGATE_NO_EXTENSIONS is set: the pure-Python path only")
    missing = [name for name, ok in status().items() if not ok]
    if missing and not shutil.which(os.environ.get("CC", "gcc")):
        pytest.skip(f"no C compiler: {missing} not built")
    assert not missing, (
        f"compiled modules not built or not importable: {missing} (pip install -e .)"
    )


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    """Start gateways on tmp data dirs; every one started is stopped at teardown."""
    started: list[GatewayProcess] = []

    def start(data_dir: Path | None = None, *args: str, **env: str) -> GatewayProcess:
        gw = GatewayProcess(data_dir or tmp_path / "data", list(args), dict(env))
        started.append(gw)
        return gw.start()

    yield start
    for gw in started:
        try:
            gw.stop()
        except Exception:
            gw.kill()


@pytest.fixture
def gateway(gateway_factory: Callable[..., GatewayProcess]) -> GatewayProcess:
    return gateway_factory()


@pytest.fixture(params=["serve", "split"])
def broker(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[InProcessBroker | ProcessBroker]:
    """Every MQTT end-to-end test runs twice: against `lightgate serve` as one process, and with
    `mqtt_processes=1` (the proxy in its own process, over the core link)."""
    b: InProcessBroker | ProcessBroker
    if os.environ.get("LIGHTGATE_TEST_INPROCESS") == "1" or not serve_has_mqtt():
        if request.param == "split":
            pytest.skip("the in-process broker has no split mode")
        b = InProcessBroker(tmp_path / "data", {}).start()
    elif request.param == "split":
        b = ProcessBroker(tmp_path / "data", split=True).start()
    elif request.param == "pure":  # only where BOTH_IMPLS asks for it
        b = ProcessBroker(tmp_path / "data", pure=True).start()
    else:
        b = ProcessBroker(tmp_path / "data").start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[InProcessBroker]:
    """An in-process broker, for tests that set embedder hooks or read server internals."""
    b = InProcessBroker(tmp_path / "embedded", {}).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """Shared local SparkSession: 2 cores, UI off, 2 shuffle partitions, the venv's python."""
    if shutil.which("java") is None:
        pytest.skip(JAVA_MISSING)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import spark_analytics

    session = (
        SparkSession.builder.master("local[2]")
        .appName("lightgate-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        # As spark_analytics.jobs.make_session: the worker handshake's 15 s default failed once
        # under the full suite (test_spark_kafka, "Python worker failed to connect back").
        .config("spark.python.authenticate.socketTimeout", "60s")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    spark_analytics.register(session)
    yield session
    session.stop()


@pytest.fixture
def tansu(tmp_path: Path) -> Iterator[Tansu]:
    """A real Kafka-compatible cluster (Tansu, memory storage) on a free port, stopped by PID."""
    t = start_tansu(tmp_path)
    try:
        yield t
    finally:
        t.stop()
