"""The ``persist`` Spark data source, found by pyspark's lookup of ``pyspark_*`` modules:
``spark.read.format("persist")`` works with no ``persist.spark.register`` call (filters are then
pushed only with ``.option("pushdown", "true")`` and ``spark.sql.python.filterPushdown.enabled``).
"""

from persist.spark import PersistDataSource as DefaultSource

__all__ = ["DefaultSource"]
