"""A Spark session with memwal's offline, headless settings and the "memwal" data source registered."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from pyspark import SparkContext
from pyspark.sql import SparkSession

LOCAL_SETTINGS: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.execution.pythonUDF.arrow.enabled": "true",
    "spark.python.worker.reuse": "true",
}
"""Settings `session` applies (callers' `conf` wins)."""


def session(
    master: str = "local[2,4]", app_name: str = "memwal", conf: dict[str, Any] | None = None
) -> SparkSession:
    """Get or create a Spark session for memwal jobs, with the data source registered.

    Binds the driver to 127.0.0.1, runs no UI, sends Python work to this interpreter
    (`PYSPARK_PYTHON` / `PYSPARK_DRIVER_PYTHON` = `sys.executable`), enables Arrow transfers, uses
    few shuffle partitions and logs errors only. `local[2,4]` is local mode with 2 threads that
    retries a failed task up to 4 times, as a cluster does (plain `local[2]` fails the job on the
    first task failure). On a cluster pass its `master` and settings in `conf`; the Python of the
    executors is then the cluster's (`spark.pyspark.python`), not changed here."""
    if master.startswith("local"):  # workers are this machine's: this interpreter, loopback only
        os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in {**LOCAL_SETTINGS, **(conf or {})}.items():
        builder = builder.config(key, str(value))
    with _jvm_started_without_fork():
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


@contextlib.contextmanager
def _jvm_started_without_fork() -> Iterator[None]:
    """Let PySpark start its JVM without forking this process.

    PySpark starts the JVM with `Popen(..., preexec_fn=...)`, a function that makes the child ignore
    SIGINT (Ctrl-C in Python must not kill Spark). A `preexec_fn` makes Python fork this interpreter,
    with Lance's threads running in it, and run its at-fork hooks: Lance's warns "lance is not
    fork-safe". Without a `preexec_fn`, subprocess starts the JVM without running Python code in a
    forked child, and the child inherits SIGINT ignored from this process for the moment of the start,
    which is what PySpark's function sets. Only when the JVM is not running yet, and on the main
    thread (the only one that may change a signal handler); otherwise PySpark starts it as usual."""
    import pyspark.java_gateway as java_gateway

    if SparkContext._gateway is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    popen = java_gateway.Popen  # type: ignore[attr-defined]  # subprocess.Popen, which it imports

    def start(*args: Any, **kwargs: Any) -> Any:
        if kwargs.pop("preexec_fn", None) is None:
            return popen(*args, **kwargs)
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return popen(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, handler if handler is not None else signal.SIG_DFL)

    java_gateway.Popen = start  # type: ignore[attr-defined, assignment]
    try:
        yield
    finally:
        java_gateway.Popen = popen  # type: ignore[attr-defined]


def register(spark: SparkSession) -> SparkSession:
    """Register the "memwal" data source with `spark` (idempotent) and enable filter pushdown
    into Python data sources, which its reader implements."""
    from memwal_df.spark.source import MemWalDataSource

    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(MemWalDataSource)
    return spark
