"""Every shell line that README.md and docs/ show a user is run here as written, from a fresh
working directory, or is listed in SKIP with the reason it is not (the promise: a new user
following only README.md and docs/ can run every command they show).

Only what a test machine needs is changed, and always the same way: listeners bind free ports
(LIGHTGATE_*_PORT=0 and the printed ports are used afterwards), `serve` runs until its ready line
and is then stopped (SIGTERM, as `kill %1` or Ctrl-C would), `mosquitto_sub` gets `-p PORT -C 1
-W 10` after a message it should receive was published, the sample traffic runs 3 s, and
`core_listen=0.0.0.0:7070` binds 127.0.0.1 on a free port. A new snippet that is neither runnable
by these rules nor in SKIP fails the test, so the docs cannot grow commands nobody ran.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from gateway_process import ROOT, parse_ready_line

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SKIP = {
    "make run": "the gateway on fixed default ports, forever; `serve` is run below on free ports",
    "make test": "this suite is `make test`",
    "make bench-mqtt": "benchmarks take minutes; they are run by hand for bench/RESULTS.md",
    ".venv/bin/python bench/": "benchmarks take minutes; they are run by hand for bench/RESULTS.md",
    ".venv/bin/lightgate proxy --core core-host:7070": "needs a core on another host; the same "
    "proxy against a core is tests/test_mqtt_split.py",
    "kcat -b gateway:9092 ": "needs a gateway with users on a host named gateway; the same kcat "
    "settings run in tests/test_kafka_sasl_clients.py",
    "kill -HUP ": "needs the pid of a gateway started by hand; the SIGHUP reload (both "
    "shapes) is tests/test_mqtt_auth.py",
    "make fuzz": "minutes of fuzzing; a short run (a fixed and a random seed) is "
    "tests/test_fuzz_socket.py",
    ".venv/bin/python tests/socket_fuzzer.py": "placeholders for a seed and batch of a failed run; "
    "the fuzzer itself runs in tests/test_fuzz_socket.py",
    "cd notebooks && ": "the notebook run is tests/test_spark_notebook.py (Spark, a minute); here "
    "only that jupyter-execute is installed is checked",
    "mosquitto_sub -h gateway.example": "a gateway with users or TLS on a named host; the same "
    "client flags against a local one are tests/test_mqtt_auth.py and tests/test_tls.py",
    "mosquitto_pub -h gateway.example": "as above (tests/test_mqtt_auth.py, tests/test_tls.py)",
    "kcat -b gateway.example": "as above, tests/test_tls.py",
    ".venv/bin/lightgate proxy --core gateway.example:7070": "needs a core on another host; "
    "the same proxy over core_tls is tests/test_core_secret.py",
    ".venv/bin/lightgate ban ": "needs a gateway running with an admin token file; the same "
    "commands (list, add with and without the token, remove, restart) run in "
    "tests/test_mqtt_bans.py",
    "promtool check rules docs/prometheus/": "reads the repository's rules, not a fresh "
    "directory's; the same command runs in tests/test_ops_prometheus.py",
    "(cd docs/prometheus && promtool test rules": "as above, tests/test_ops_prometheus.py",
    "mosquitto -c central.conf": "docs/bridges.md's central broker on its fixed port: "
    "tests/test_bridge.py::test_docs_edge_to_centre runs that page's central.conf and edge.toml "
    "on free ports, with the same mosquitto_sub and mosquitto_pub lines",
    ".venv/bin/lightgate serve --config edge.toml": "as above (test_docs_edge_to_centre)",
    "mosquitto_sub -h 127.0.0.1 -p 1884": "as above (test_docs_edge_to_centre)",
    "mosquitto_pub -h 127.0.0.1 -p 188": "as above (test_docs_edge_to_centre)",
}

PORTS = ("MQTT", "MQTTS", "WS", "WSS", "KAFKA", "KAFKA_TLS", "HTTP")


def snippet_lines() -> list[tuple[str, str]]:
    """(doc, command line) for every non-comment line of every sh block, in document order."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```(?:sh|bash|shell)\n(.*?)```", text, re.S):
            for line in block.splitlines():
                cmd = re.sub(r"\s+#.*$", "", line).strip()
                if cmd and not cmd.startswith("#"):
                    out.append((doc.name, cmd))
    return out


class Runner:
    """Runs the lines of one document in one working directory, like a user's shell would."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.env = {**os.environ, "LIGHTGATE_LOG_FORMAT": "text"}
        self.env.update({f"LIGHTGATE_{p}_PORT": "0" for p in PORTS})
        self.env.pop("LIGHTGATE_DATA_DIR", None)
        self.ports: dict[str, int] = {}
        self.background: subprocess.Popen[bytes] | None = None

    def run(self, cmd: str) -> None:
        for prefix, reason in SKIP.items():
            if cmd.startswith(prefix):
                if prefix == "cd notebooks && ":
                    assert (ROOT / ".venv/bin/jupyter-execute").exists() or shutil.which(
                        "jupyter-execute"
                    ), reason
                return
        background = cmd.endswith(" &")
        words = shlex.split(cmd.removesuffix(" &"))
        env = dict(self.env)
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words == ["kill", "%1"]:
            self.stop_background()
        elif words[:2] == [".venv/bin/lightgate", "serve"] and "--help" not in words:
            self.serve(words, env, keep=background)
        elif words[:2] == [".venv/bin/lightgate", "status"]:
            self.status(words[2:], env)
        elif words[0] == "mosquitto_sub":
            self.mosquitto_sub(words)
        elif words[:2] == [".venv/bin/python", "scripts/sample_traffic.py"]:
            words = [self._port_in(w) for w in words] + ["--seconds", "3"]
            self.check(words, env)
        else:
            assert not background, f"no rule for a background command: {cmd}"
            self.check(words, env)

    def check(self, words: list[str], env: dict[str, str], timeout: float = 120) -> str:
        if words[0] == "cp" and not (self.cwd / words[1]).exists():
            shutil.copy(ROOT / words[1], self.cwd / words[1])
        proc = subprocess.run(
            words, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, f"{shlex.join(words)} exited {proc.returncode}:\n{proc.stderr}"
        return proc.stdout

    def serve(self, words: list[str], env: dict[str, str], keep: bool) -> None:
        words = [w.replace("core_listen=0.0.0.0:7070", "core_listen=127.0.0.1:0") for w in words]
        log = self.cwd / "serve.log"
        with open(log, "ab") as err:
            proc = subprocess.Popen(
                words, cwd=self.cwd, env=env, stdout=subprocess.PIPE, stderr=err,
                start_new_session=True,
            )  # fmt: skip
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("lightgate ready"):
            proc.kill()
            tail = log.read_text(errors="replace")[-3000:]
            pytest.fail(f"{shlex.join(words)} did not become ready: {line!r}\n{tail}")
        self.ports = {name: port for name, (_, port) in parse_ready_line(line).items()}
        self.background = proc
        if not keep:
            self.stop_background()

    def status(self, args: list[str], env: dict[str, str]) -> None:
        """`lightgate status` against the running gateway's HTTP port; `--watch` redraws twice,
        0.2 s apart, instead of until Ctrl-C."""
        assert self.background is not None, "status needs a running gateway"
        out: list[str] = []
        it = iter(args)
        for w in it:
            if w in ("--url", "--count"):
                next(it)
            elif w == "--watch":
                out += ["--watch", "0.2", "--count", "2"]
            elif not re.fullmatch(r"[0-9.]+", w):  # drop --watch's own interval
                out.append(w)
        url = f"http://127.0.0.1:{self.ports['http']}"
        text = self.check([".venv/bin/lightgate", "status", *out, "--url", url], env)
        text = text.replace("\x1b[H\x1b[2J", "")  # --watch's clear-screen
        assert text.startswith("lightgate ") and " OK " in text.splitlines()[0], text

    def stop_background(self) -> None:
        proc, self.background = self.background, None
        assert proc is not None, "nothing runs in the background"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0

    def _port_in(self, word: str) -> str:
        for name, default in (("mqtt", "1883"), ("kafka", "9092")):
            if word == f"127.0.0.1:{default}":
                return f"127.0.0.1:{self.ports[name]}"
        return word

    def mosquitto_sub(self, words: list[str]) -> None:
        if shutil.which("mosquitto_sub") is None:
            pytest.skip("mosquitto_sub not installed (scripts/system-deps.sh)")
        if self.background is None:  # the docs start from a running gateway (`make run`)
            self.serve([".venv/bin/lightgate", "serve"], self.env, keep=True)
        port = self.ports["mqtt"]
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "docs-snippets-pub")
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        pub.publish("plant/line1/temp", b"21.5", qos=1).wait_for_publish(5)
        pub.disconnect()
        pub.loop_stop()
        out = self.check([*words, "-p", str(port), "-C", "1", "-W", "10"], self.env, timeout=20)
        assert out.strip().endswith("plant/line1/temp 21.5"), out

    def close(self) -> None:
        if self.background is not None:
            self.stop_background()


def test_the_snippets_are_found() -> None:
    lines = snippet_lines()
    assert ("README.md", "make run") in lines and len(lines) > 20
    assert any(doc == "replay.md" and cmd.startswith("mosquitto_sub") for doc, cmd in lines)


@pytest.mark.parametrize("doc", [d.name for d in DOCS if "```sh" in d.read_text()])
def test_every_shell_line_runs_as_written(doc: str, tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    for name in ("scripts", "notebooks", "bench"):
        (tmp_path / name).symlink_to(ROOT / name)
    runner = Runner(tmp_path)
    t0 = time.monotonic()
    try:
        for d, cmd in snippet_lines():
            if d == doc:
                runner.run(cmd)
    finally:
        runner.close()
    assert time.monotonic() - t0 < 240
