"""The three aiokafka clients a `KafkaLog` uses (a raw client for metadata and Fetch, the
producer, the admin client), connected with the `kafka_client_<name>` keywords each takes,
retried until `kafka_connect_timeout_s` with the reason logged, and stopped again."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient

from store.config import StoreError

log = logging.getLogger("lightgate.store.kafka_log")


class ClusterUnreachableError(StoreError):
    """The Kafka cluster did not answer within `kafka_connect_timeout_s`."""


def _kwargs_for(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    names = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in names}


async def connect(
    bootstrap: str, client_kwargs: dict[str, Any], timeout_s: float
) -> tuple[Any, Any, Any]:
    """(client, producer, admin), all started; what was started is stopped again on failure.
    `client_kwargs`: the `kafka_client_<name>` settings, each given to the clients taking it."""
    started: list[Any] = [None, None, None]
    try:
        await _connect(bootstrap, client_kwargs, timeout_s, started)
    except BaseException:
        await stop_clients(started[1], started[2], started[0])
        raise
    return started[0], started[1], started[2]


async def _connect(
    bootstrap: str, client_kwargs: dict[str, Any], timeout_s: float, started: list[Any]
) -> None:
    kw = dict(client_kwargs)
    idempotent = bool(kw.pop("enable_idempotence", True))
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        attempt += 1
        client = AIOKafkaClient(bootstrap_servers=bootstrap, **_kwargs_for(AIOKafkaClient, kw))
        try:
            left = max(0.1, deadline - time.monotonic())
            await asyncio.wait_for(client.bootstrap(), left)
            started[0] = client
            break
        except Exception as exc:
            await client.close()
            if time.monotonic() >= deadline:
                raise ClusterUnreachableError(
                    f"cannot reach the Kafka cluster at {bootstrap} within {timeout_s:g} s: {exc!r}"
                ) from None
            log.warning(
                "Kafka cluster %s not reachable (attempt %d: %r); retrying",
                bootstrap, attempt, exc,
            )  # fmt: skip
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    pkw: dict[str, Any] = {"acks": "all", "enable_idempotence": idempotent, "linger_ms": 0}
    pkw.update(_kwargs_for(AIOKafkaProducer, kw))
    pkw["max_batch_size"] = max(int(pkw.get("max_batch_size", 0)), 2 << 20)
    producer = started[1] = AIOKafkaProducer(bootstrap_servers=bootstrap, **pkw)
    try:
        await producer.start()
    except Exception as exc:
        hint = (
            " (the cluster refused InitProducerId; set kafka_client_enable_idempotence = false"
            " for a cluster without idempotent producers, such as Tansu)"
            if idempotent
            else ""
        )
        raise StoreError(f"cannot start the Kafka producer: {exc!r}{hint}") from None
    admin = started[2] = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, **_kwargs_for(AIOKafkaAdminClient, kw)
    )
    await admin.start()


async def stop_clients(producer: Any, admin: Any, client: Any) -> None:
    for c in (producer, admin, client):
        if c is not None:
            try:
                await (c.stop() if c is producer else c.close())
            except Exception:
                log.exception("closing a Kafka client")
