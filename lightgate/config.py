"""Gateway configuration: one TOML file, overridden by `LIGHTGATE_*` env vars, overridden by CLI flags.

Every key is flat (`mqtt_port = 1883`) so that the three sources name things the same way; a TOML
table such as `[store]` is accepted too and flattened as `store_<key>` only when that key exists.

`GatewayConfig` is the one table of keys: each row gives the name, the type, the default, the
allowed range or choices and a one-line description (`key(...)`). The validator
(lightgate/config_load.py), the table in docs/configuration.md and lightgate.example.toml all
come from it (lightgate/config_docs.py writes the two files; tests keep them equal). Adding a key
is adding a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from store.auth.http_hook import DEFAULT_ACL_BODY, DEFAULT_CONNECT_BODY

T = TypeVar("T")

MAX_INT32 = 2**31 - 1
MAX_UINT32 = 2**32 - 1
MQTT_MAX_PACKET = 268_435_460  # 1 + 4 bytes of fixed header + 268,435,455 (MQTT's limit)


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


@dataclass(frozen=True, slots=True)
class KeySpec:
    """What a key accepts: an int range `lo..hi` (plus the special values `also`), a set of
    string `choices`, or anything of the type. `allowed` overrides the docs' wording."""

    doc: str
    lo: int | None = None
    hi: int | None = None
    also: tuple[int, ...] = ()
    choices: tuple[str, ...] = ()
    allowed: str = ""
    words: tuple[str, ...] = ()  # an int key's named values besides its range (`"auto"`)


def key(
    default: T,
    doc: str,
    *,
    lo: int | None = None,
    hi: int | None = None,
    also: tuple[int, ...] = (),
    choices: tuple[str, ...] = (),
    allowed: str = "",
    words: tuple[str, ...] = (),
) -> T:
    """One row of the table: a dataclass field whose metadata says what the key accepts."""
    spec = KeySpec(doc, lo, hi, also, choices, allowed, words)
    return cast(T, field(default=default, metadata={"key": spec}))


PORT: dict[str, Any] = {"lo": -1, "hi": 65535}  # 0 picks a free port, -1 disables the listener
DAY_MS = 24 * 3600 * 1000


@dataclass(slots=True)
class GatewayConfig:
    # Listeners.
    data_dir: str = key(
        "./data",
        "data directory (commitlog, light queues, Kafka group state); locked by one writer",
        allowed="a directory path",
    )
    host: str = key(
        "127.0.0.1", "listen address of every listener", allowed="a host name or IP address"
    )
    mqtt_port: int = key(1883, "MQTT over TCP", **PORT)
    mqtts_port: int = key(
        8883, "MQTT over TLS; only started when `tls_cert` and `tls_key` are set", **PORT
    )
    ws_port: int = key(8083, "MQTT over WebSocket, path `/mqtt`, subprotocol `mqtt`", **PORT)
    wss_port: int = key(
        8084,
        "MQTT over WebSocket over TLS; only started when `tls_cert` and `tls_key` are set",
        **PORT,
    )
    kafka_port: int = key(9092, "Kafka wire protocol", **PORT)
    kafka_tls_port: int = key(
        9093,
        "Kafka wire protocol over TLS (`security.protocol=SSL`); only started when `tls_cert` and "
        "`tls_key` are set",
        **PORT,
    )
    http_port: int = key(
        8080,
        "HTTP: `/health`, `/metrics` (Prometheus), `/api/stats` and the dashboard `/` "
        "(docs/operations.md)",
        **PORT,
    )
    http_admin_token_file: str = key(
        "",
        "a file holding the bearer token that HTTP requests changing state must present "
        '(`/api/bans` POST/DELETE, `lightgate ban add/remove`); `""`: such requests are refused',
        allowed='a file path, or `""`',
    )
    tls_cert: str = key(
        "",
        "PEM certificate chain of the TLS listeners (MQTT/TLS, WSS, Kafka/TLS, the core link with "
        "`core_tls`; read at start, the listeners' again on SIGHUP)",
        allowed='a file path, or `""`',
    )
    tls_key: str = key(
        "",
        "PEM private key of `tls_cert` (read at start, the listeners' again on SIGHUP)",
        allowed='a file path, or `""`',
    )
    tls_ca: str = key(
        "",
        "PEM CA certificates that sign client certificates: a client certificate presented on a "
        "TLS listener is verified against them (a bad one fails the handshake). A proxy verifies "
        "the core's certificate with them on a `core_tls` link",
        allowed='a file path, or `""`',
    )
    tls_require_client_cert: bool = key(
        False,
        "TLS listeners refuse clients without a certificate signed by `tls_ca` (MQTT: CONNACK "
        "0x05 / 0x87; Kafka and the core link: the TLS handshake fails). Plain listeners are "
        "not affected: disable them (`-1`) for TLS only",
    )
    tls_identity_as_username: bool = key(
        False,
        "MQTT over TLS/WSS: the client certificate's CN is the user name (no password asked; "
        "a client without a certificate is refused, 0x05 / 0x87). Needs `tls_ca`",
    )

    # Store (commitlog).
    log: str = key(
        "local",
        "where the log lives: `local` (segments in the data dir) or `kafka` (the topics of a "
        "Kafka cluster at `kafka_bootstrap`; Lightgate's own Kafka listener is then off; "
        "docs/deployment.md). `kafka_client_<name>` keys are handed to the Kafka client as its "
        'keyword `<name>` (e.g. `kafka_client_security_protocol = "SASL_SSL"`)',
        choices=("local", "kafka"),
    )
    kafka_bootstrap: str = key(
        "",
        '`log = "kafka"`: the cluster\'s bootstrap servers',
        allowed='`"host:port,..."`',
    )
    kafka_topic_partitions: int = key(
        0,
        '`log = "kafka"`: partitions of a log topic Lightgate creates on the cluster; '
        "`0`: `default_partitions`",
        lo=0,
        hi=1024,
    )
    kafka_replication_factor: int = key(
        -1,
        '`log = "kafka"`: replicas of a log topic Lightgate creates; `-1`: the cluster\'s default',
        lo=-1,
        hi=32,
    )
    kafka_connect_timeout_s: int = key(
        60,
        '`log = "kafka"`: `serve` retries an unreachable cluster this long, then exits non-zero',
        lo=1,
        hi=86_400,
    )
    default_partitions: int = key(
        4, "partitions of a log topic created on first use", lo=1, hi=1024
    )
    cluster_sessions_topic: str = key(
        "__lightgate_sessions",
        '`log = "kafka"`: the cluster topic (one partition, compacted where the cluster can) '
        "through which the nodes own client ids and hand persistent sessions over: a CONNECT on "
        "one node ends the client's connection on another (0x8E) and resumes its session there; "
        'costs one produce and one read of the topic per CONNECT; `""`: off, client ids and '
        "sessions stay per node (docs/deployment.md)",
        allowed='a Kafka topic name, or `""`',
    )
    cluster_sessions_poll_ms: int = key(
        20,
        '`log = "kafka"`: longest wait of a read of `cluster_sessions_topic`; a cluster that '
        "does not answer a waiting read when records arrive (Tansu) adds up to this much to "
        "every CONNECT (measured on Tansu: 20 ms gave a 14 ms median CONNECT and no idle "
        "cost to measure, 5 ms 5 ms and 2-5 % of a core idle; bench/results-issue-43a.md)",
        lo=1,
        hi=1000,
    )
    cluster_handover_wait_ms: int = key(
        1000,
        '`log = "kafka"`: how long a node that claims a client id waits for the previous '
        "owner's hand-over record before it resumes the last stored state of the session",
        lo=0,
        hi=60_000,
    )
    cluster_state_flush_ms: int = key(
        1000,
        '`log = "kafka"`: how often a node writes the persistent sessions that changed (with '
        "their pending wills) to `cluster_sessions_topic`, batched: a node that dies is "
        "resumed elsewhere from state at most this old; also its heartbeat period's bound",
        lo=50,
        hi=60_000,
    )
    cluster_node_timeout_ms: int = key(
        6000,
        '`log = "kafka"`: a node whose heartbeat (every third of this) has not been read for '
        "this long is dead: the surviving nodes take its persistent sessions over and publish "
        "their wills once, after their delay (docs/deployment.md)",
        lo=500,
        hi=600_000,
    )
    fsync: str = key(
        "always",
        "default fsync policy of new topics: `always` (group commit; "
        "acks wait for fsync), `interval_ms`, `never`",
        choices=("always", "interval_ms", "never"),
    )
    fsync_interval_ms: int = key(
        200,
        "flush interval under `interval_ms` (and the timer that fsyncs unacknowledged writes: "
        "each fsync disturbs delivery on a small machine, see below)",
        lo=1,
        hi=3_600_000,
    )
    segment_bytes: int = key(
        256 << 20,
        "roll a new segment past this size (256 MiB; at least "
        "64 KiB, at most 2 GiB - 1 as in Kafka)",
        lo=64 << 10,
        hi=MAX_INT32,
    )
    retention_ms: int = key(
        7 * DAY_MS, "delete whole segments older than this (7 days); `-1` keeps forever", lo=-1
    )
    retention_bytes: int = key(-1, "per-partition size bound; `-1` means unbounded", lo=-1)
    retention_check_interval_ms: int = key(60_000, "how often retention runs", lo=100, hi=DAY_MS)

    # MQTT.
    max_packet_size: int = key(
        1 << 20,
        "largest MQTT packet accepted (bytes); larger → "
        "disconnect (v5 reason 0x95); `0` means no limit (MQTT's own, "
        "256 MiB), as in Mosquitto",
        lo=20,
        hi=MQTT_MAX_PACKET,
        also=(0,),
    )
    max_keepalive: int = key(
        600,
        "largest keep alive granted (s); v5 clients asking more get Server Keep Alive",
        lo=1,
        hi=65535,
    )
    receive_maximum: int = key(
        64,
        "outbound QoS 1/2 in-flight window per client (v5 clients may ask less). Each message in "
        "flight holds ~300 B plus its packet until acknowledged; a QoS 1 reader that takes a whole "
        "fan-in is bound by it (one subscriber of 10 publishers: 58k msg/s at 64, 265k at 1024, "
        "bench/RESULTS.md)",
        lo=1,
        hi=65535,
    )
    topic_alias_out: bool = key(
        True,
        "MQTT 5: give outbound PUBLISHes server-assigned topic aliases for clients that announce "
        "a Topic Alias Maximum (later messages on a topic carry an empty topic name); see "
        'docs/interfaces.md "MQTT 5 topic aliases"',
    )
    max_topic_alias_out: int = key(
        256,
        "topics numbered for outbound aliases, shared by all connections (a client uses up to "
        "its own maximum); past this, the most frequent topics take the numbers",
        lo=1,
        hi=65535,
    )
    max_session_expiry: int = key(
        7 * 24 * 3600,
        "cap on v5 session expiry (s); v3 persistent sessions use this too",
        lo=0,
        hi=MAX_UINT32,
    )
    max_replay_depth_ms: int = key(
        7 * DAY_MS, "how far back `$replay/...` may reach (7 days)", lo=0
    )
    sys_interval_s: int = key(
        10, "`$SYS/broker/...` publish interval; `0` disables", lo=0, hi=86400
    )
    connect_timeout_s: int = key(
        10,
        "a new connection must send CONNECT (or finish the WebSocket upgrade) within this",
        lo=1,
        hi=3600,
    )
    max_connections: int = key(
        0,
        "connected MQTT clients (all MQTT listeners together; Kafka connections have "
        "`kafka_max_connections`); one more gets CONNACK 0x89 Server busy (v5) / 0x03 (3.1.1); `0`: no limit",
        lo=0,
    )
    max_connection_rate: int = key(
        0,
        "new MQTT connections per second from one IP address (token bucket, burst of one "
        "second); beyond: CONNACK 0x9F (v5) / 0x03 (3.1.1); `0`: no limit",
        lo=0,
    )
    max_publish_rate: int = key(
        0,
        "PUBLISH per second per MQTT client (token bucket, burst of one second); beyond it the "
        "gateway stops reading the client until tokens refill (docs/security.md); `0`: no limit",
        lo=0,
    )
    max_publish_bytes_rate: int = key(
        0,
        "PUBLISH payload bytes per second per MQTT client (token bucket, burst of one second; "
        "a larger payload passes and is paid for after); beyond it the gateway stops reading "
        "the client as for `max_publish_rate`; `0`: no limit",
        lo=0,
    )
    flapping_max_disconnects: int = key(
        0,
        "flapping detection: this many disconnects of one MQTT client id within "
        "`flapping_window_s` ban it for `flapping_ban_s` (CONNACK 0x8A Banned / 0x05); `0`: off",
        lo=0,
    )
    flapping_window_s: int = key(
        60, "the sliding window of `flapping_max_disconnects`", lo=1, hi=86400
    )
    flapping_ban_s: int = key(
        300, "how long a flapping client is banned (`lightgate ban remove` lifts it)", lo=1
    )
    flapping_ban_address: bool = key(
        False, "a flapping client's source address is banned too (every client id from it)"
    )
    slow_consumer_timeout_s: int = key(
        60,
        "an MQTT subscriber whose socket stays full this long is disconnected (its persistent "
        "session keeps its position); `0`: never",
        lo=0,
        hi=86400,
    )
    allow_anonymous: str = key(
        "auto",
        "accept clients without a user name (MQTT CONNECT without one); `auto`: only when "
        "`host` is a loopback address and no source of identity is set (`password_file`, "
        "`auth_jwt_*` keys, `auth_http_connect_url`; docs/security.md)",
        choices=("auto", "true", "false"),
    )
    password_file: str = key(
        "",
        "users and password hashes in `mosquitto_passwd` format (`lightgate passwd`); "
        "reloaded on SIGHUP",
        allowed='a file path, or `""`',
    )
    acl_file: str = key(
        "",
        'topic rights in Mosquitto\'s `acl_file` syntax; `""` allows everything; reloaded on '
        "SIGHUP",
        allowed='a file path, or `""`',
    )
    # A JWT as the MQTT password and the Kafka OAUTHBEARER token (docs/security.md).
    auth_jwt_secret_file: str = key(
        "",
        "HS256 secret (at least 32 bytes; surrounding whitespace ignored) verifying JWTs; "
        "reloaded on SIGHUP",
        allowed='a file path, or `""`',
    )
    auth_jwt_key_file: str = key(
        "",
        "PEM public key (RSA for RS256, P-256 for ES256) or JWKS document verifying JWTs; "
        "reloaded on SIGHUP",
        allowed='a file path, or `""`',
    )
    auth_jwt_jwks_url: str = key(
        "",
        "URL of a JWKS verifying JWTs, fetched at the first token, every "
        "`auth_jwt_jwks_refresh_s` and for a `kid` it lacks",
        allowed='an http(s) URL, or `""`',
    )
    auth_jwt_jwks_refresh_s: int = key(300, "seconds between JWKS fetches", lo=1, hi=86400)
    auth_jwt_jwks_min_interval_s: int = key(
        10,
        "a token naming an unknown `kid` fetches the JWKS again at most this often",
        lo=0,
        hi=3600,
    )
    auth_jwt_algorithms: str = key(
        "HS256,RS256,ES256",
        "accepted JWT algorithms, comma-separated (a key is used only with its own algorithm)",
        allowed="a comma-separated subset of `HS256`, `RS256`, `ES256`",
    )
    auth_jwt_username_claim: str = key(
        "sub", "JWT claim holding the user name (no such claim: no user name)", allowed="a name"
    )
    auth_jwt_acl_claim: str = key(
        "acl",
        'JWT claim holding the client\'s rights, `{"pub": [...], "sub": [...], "all": [...]}` '
        "topic filters with `%u`/`%c`; a token without it gets the `acl_file` rules of its user",
        allowed="a name",
    )
    auth_jwt_issuer: str = key(
        "", 'required `iss` of JWTs; `""`: not checked', allowed='a string, or `""`'
    )
    auth_jwt_audience: str = key(
        "", 'required `aud` of JWTs; `""`: not checked', allowed='a string, or `""`'
    )
    auth_jwt_leeway_s: int = key(0, "clock skew allowed on `exp` and `nbf`", lo=0, hi=3600)
    auth_jwt_require_exp: bool = key(True, "refuse a JWT without `exp`")

    # A web service deciding CONNECTs and topic rights (docs/security.md).
    auth_http_connect_url: str = key(
        "",
        "URL POSTed for each MQTT CONNECT that does not carry a JWT; a 2xx answer accepts",
        allowed='an http(s) URL, or `""`',
    )
    auth_http_acl_url: str = key(
        "",
        "URL POSTed for each (client, topic, publish/subscribe) not in the cache; a 2xx "
        "answer allows",
        allowed='an http(s) URL, or `""`',
    )
    auth_http_connect_body: str = key(
        DEFAULT_CONNECT_BODY,
        "fields of the CONNECT request's JSON body: `name=value` pairs, comma-separated, with "
        "`%u` user, `%P` password, `%c` client id, `%a` peer address",
        allowed="`name=value[,name=value...]`",
    )
    auth_http_acl_body: str = key(
        DEFAULT_ACL_BODY,
        "fields of the topic request's JSON body: `%u`, `%c`, `%t` topic, `%A` access "
        "(the number 1 subscribe, 2 publish)",
        allowed="`name=value[,name=value...]`",
    )
    auth_http_timeout_ms: int = key(
        2000,
        "a hook request not answered in this time (waiting for a slot included) refuses",
        lo=10,
        hi=60_000,
    )
    auth_http_cache_ttl_s: int = key(
        60, "hook answers are reused this long (per user, client and topic)", lo=1, hi=86400
    )
    auth_http_max_in_flight: int = key(
        16, "hook requests running at once; more wait their turn", lo=1, hi=1024
    )

    filter_grace_ms: int = key(
        60_000, "a wildcard light queue with no subscribers is dropped after this", lo=0, hi=DAY_MS
    )

    # Kafka.
    kafka_auto_create_topics: bool = key(True, "Metadata/Produce for an unknown topic creates it")
    kafka_produce_byte_rate: int = key(
        0,
        "produce quota per Kafka connection (bytes/s, burst of one second); over it the "
        "response carries `throttle_time_ms` and the connection is not read for that long, "
        "as Kafka does; `0`: no limit",
        lo=0,
    )
    kafka_max_connections: int = key(
        0,
        "open Kafka connections (plain and TLS listeners together); one more is closed at "
        "once without an answer and the client retries after its backoff; `0`: no limit",
        lo=0,
    )
    kafka_max_frame_bytes: int = key(
        100 << 20,
        "largest Kafka request frame; larger closes the connection",
        lo=1024,
        hi=MAX_INT32,
    )

    # Processes.
    mqtt_processes: int | str = key(
        0,
        "`0`: the MQTT proxy runs inside `serve` (one process). `N` (1 or more): `serve` starts "
        "N proxy processes (`lightgate proxy`) that share the MQTT, TLS and WebSocket ports "
        "(SO_REUSEPORT) and reach the store, light queues and notify over the core link; the core "
        "owns client ids, wills and retained messages across them. `auto`: one per core, minus "
        'one for the core when there are more than 2 (docs/architecture.md, "Processes and cores")',
        lo=0,
        hi=256,
        words=("auto",),
    )
    core_listen: str = key(
        "",
        "the core link's address when a proxy runs in its own process: "
        '`""` = a Unix socket `DATA/core.sock`; `host:port` (TCP; port `0` picks one, printed as '
        "`core=` in the ready line) or `unix:/path`. With every MQTT listener of `serve` disabled "
        "and `core_listen` set, `serve` is a core only, for `lightgate proxy --core HOST:PORT` processes "
        "running elsewhere. A TCP link needs `core_secret`; `core_tls` encrypts it",
        allowed='`""`, `host:port`, `unix:/path`',
    )
    core_secret: str = key(
        "",
        "shared secret of the core link: both ends prove they know it (HMAC-SHA256 "
        "challenge-response, never sent). Required when `core_listen` is TCP; better given as "
        "`core_secret_file` or `LIGHTGATE_CORE_SECRET` than in the TOML file",
        allowed='a string, or `""`',
    )
    core_secret_file: str = key(
        "",
        "a file whose content (trailing newline stripped) is `core_secret` (`--core-secret-file`)",
        allowed='a file path, or `""`',
    )
    core_tls: bool = key(
        False,
        "a TCP core link uses TLS: the core presents `tls_cert` (and with "
        "`tls_require_client_cert` asks the proxy for its own, signed by `tls_ca`); the proxy "
        "verifies the core's certificate with `tls_ca` and the host name of `--core`",
    )
    publish_gather_ms: int = key(
        0,
        "per MQTT proxy: a PUBLISH read while none is waiting waits this long for others from "
        "any connection before their one append, dispatch round and delivery pass (0: at the "
        "end of the loop pass that read it). At many devices each sending seldom, a pass "
        "carries 1-2 messages and those steps run per message; 1 ms cut CPU per message ~17 % "
        "at 1000 devices x 2 msg/s, for up to that much latency",
        lo=0,
        hi=100,
    )
    recent_cache_bytes: int = key(
        64 << 20,
        "per MQTT proxy: bytes of its own recently appended "
        "messages kept for delivery, so a subscriber up to this far behind is served without a "
        "store read (64 MiB; each message counts its record's bytes plus 240, which overestimates "
        "what it holds; once full, the oldest 64th goes at a time)",
        lo=0,
    )

    # Logging.
    log_format: str = key(
        "json", "`json` (one object per line on stderr) or `text`", choices=("json", "text")
    )
    log_level: str = key(
        "info",
        "least severe level logged",
        choices=("debug", "info", "warning", "error", "critical"),
    )

    # Operations (docs/operations.md).
    probe_interval_ms: int = key(
        1000,
        "latency probes: one timestamped QoS 1 message through the whole MQTT pipeline every "
        "this often, on `__lightgate_probe/<id>` (invisible to `#` subscribers and Spark's "
        "default topics); `0` turns probes off",
        lo=0,
        hi=DAY_MS,
    )
    probe_timeout_ms: int = key(
        5000,
        "a probe not delivered within this long makes `/health` 503 (and logs one line)",
        lo=100,
        hi=DAY_MS,
    )
    dispatch_stall_ms: int = key(
        10_000,
        "`/health` is 503 when the dispatcher is behind and indexed nothing for this long",
        lo=100,
        hi=DAY_MS,
    )
    conn_log_per_s: int = key(
        20,
        "connection lifecycle log lines (connect, disconnect, with a connection id) per second; "
        "past it, one summary line per second counts the rest; `0` logs none",
        lo=0,
        hi=1_000_000,
    )

    # Process.
    gc_gen0: int = key(
        5_000,
        "CPython's young-generation GC threshold "
        "(`gc.set_threshold(N, 20, 100)`); `0` keeps CPython's defaults (700, 10, 10). Larger "
        "runs fewer collections over the long-lived caches but each young one pauses the loop "
        "longer: at 50000 one pause a second of ~15 ms was the p999 latency at 1k msg/s, at "
        "5000 it is ~2 ms (`docs/performance-history.md`)",
        lo=0,
        hi=10**9,
    )

    gc_freeze: bool = key(
        True,
        "Once the gateway is ready, move every object alive then into CPython's permanent GC "
        "generation (`gc.freeze`): full collections skip the ~51,000 objects of the start-up "
        "heap (17-20 ms a collection, the loop stopped, `docs/performance-history.md`)",
    )

    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)
