"""Spark analytics on the Lightgate commitlog: the `lightgate` PySpark data source and jobs.

import spark_analytics
spark_analytics.register(spark)
df = spark.read.format("lightgate").load("./data")
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from spark_analytics.arrow_decode import SCHEMA
from spark_analytics.source import LightgateDataSource
from store.mapping import DEVICE_EVENTS_TOPIC as DEVICE_EVENTS_TOPIC

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def use_this_python(spark: SparkSession) -> bool:
    """Point a local session's Python workers at this interpreter, unless the user chose one.

    PySpark starts its Python workers (which run the data source's reader) with `$PYSPARK_PYTHON`,
    else a bare `python3` from PATH -- usually the system Python, which lacks cramjam and this
    package, so reads fail with `No module named 'cramjam'`. Inside a venv the interpreter running
    the driver is the one with everything installed. Only local masters are changed: on a cluster
    this path may not exist on the executors (set PYSPARK_PYTHON there). Returns True if changed.
    """
    if os.environ.get("PYSPARK_PYTHON"):
        return False
    try:
        sc = spark.sparkContext  # not available over Spark Connect: its server decides
    except Exception:
        return False
    if not str(sc.master).startswith("local") or sc.pythonExec == sys.executable:
        return False
    # The context reads PYSPARK_PYTHON once at start; data sources and UDFs take `pythonExec`
    # when they are created, so setting both covers everything registered from now on.
    sc.pythonExec = sys.executable
    os.environ["PYSPARK_PYTHON"] = sys.executable
    return True


def register(spark: SparkSession) -> None:
    """Make `format("lightgate")` available in this session (batch and streaming).

    In local mode this also runs Spark's Python workers with this interpreter (`use_this_python`)
    unless `PYSPARK_PYTHON` is set.
    """
    use_this_python(spark)
    spark.dataSource.register(LightgateDataSource)


__all__ = ["DEVICE_EVENTS_TOPIC", "SCHEMA", "LightgateDataSource", "register", "use_this_python"]
