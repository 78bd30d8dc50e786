"""Spark analytics on the Lightgate commitlog: the `lightgate` PySpark data source and jobs.

import spark_analytics
spark_analytics.register(spark)
df = spark.read.format("lightgate").load("./data")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark_analytics.arrow_decode import SCHEMA
from spark_analytics.source import LightgateDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEVICE_EVENTS_TOPIC = "__lightgate_device_events"


def register(spark: SparkSession) -> None:
    """Make `format("lightgate")` available in this session (batch and streaming)."""
    spark.dataSource.register(LightgateDataSource)


__all__ = ["DEVICE_EVENTS_TOPIC", "SCHEMA", "LightgateDataSource", "register"]
