"""The log on a Kafka cluster (`log = "kafka"`): a Kafka *client*, not the Kafka server.

`kafka_log.KafkaLog` is the `store.backend.LogBackend` the gateway runs on when its log lives on
a cluster. It holds the parts it delegates to, each given only the state it uses:
`appender.ClusterAppender` (produce what the local log would write, acks=all),
`offsets_by_time.OffsetsByTime` (first offset at/after a time), `batch_cache.BatchCache` (the
fetched batches, in memory) and `txns.ClusterTxns` (aborted transactions, from their markers). `reader` is the raw
Fetch/ListOffsets layer, also used alone by Spark's source.

`store/__init__.py` imports nothing from here: the local log does not pull in aiokafka.
"""
