"""tpch: TPC-H queries in Spark SQL over persist shards, against the same queries over Parquet.

The data is TPC-H at ``tpch_scale_factor`` as written by ``tpchgen-cli parquet`` (one Parquet
file per table: the baseline), and every table loaded into its own persist shard (file blob +
Postgres consensus) with persist's Python API: the big tables in ``_APPENDS`` appends, then
``maintain``. In one Spark session (``local[2]``, in a child process so that its JVM is the
bench's own), the queries (``queries()``: the standard texts with the spec's default
substitution parameters) run as Spark SQL over temp views of each table:

- ``spark parquet``: ``spark.read.parquet`` of tpchgen's files (the baseline);
- ``persist native``: ``persist.spark.read(spark, shard=...)``, Spark's own Parquet reader over
  persist's parts (the fast path);
- ``persist verified``: ``spark.read.format("persist")``, the Python data source that checks
  every part;
- ``bare python source``: ``format("bare")`` (``benches/bare.py``) over tpchgen's files, a Python
  source that only hands Spark ready-made Arrow batches: the ceiling of any Python source here
  (Spark 4.3 prunes no column of one), against which ``persist verified`` is also set.

Each query runs once per system untimed (warm-up), then ``tpch_repeats`` timed rounds,
interleaved (query by query, system by system; after the first, a round starts only within
``tpch_budget_s``); a figure is the best round (with no timed round, the smoke scale, the
warm-up's). Every answer of another system must equal
the Parquet answer (same column types, same rows; the rows sorted first where the query's order
is not total): a mismatch fails the scenario.

Then Spark writes ``lineitem`` with ``df.write.parquet``, ``format("persist")`` and
``format("bare")``, and Q1 and Q6 run over what the writes made, at once (``tpch_writes.py``).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import persist
from benches import bare
from benches.fixtures import NoAdapter
from benches.harness import BASELINE, SUBJECT, Context, Run, System, ratio
from benches.harness import ratio_entry as entry
from benches.procs import local_spark, run_in_child
from benches.tpch_writes import FRESH_QUERIES, lineitem_writes

NAME = "tpch"
TITLE = "TPC-H: Spark SQL over persist shards vs over the same Parquet files"

PARQUET = "spark parquet"
NATIVE = "persist native (persist.spark.read)"
VERIFIED = 'persist verified (format("persist"))'
BARE = 'bare python source (format("bare"))'
GENERATOR = "tpchgen-cli"
TABLES = ("region", "nation", "supplier", "customer", "part", "partsupp", "orders", "lineitem")
# Loaded in _APPENDS appends (the others in one).
_BIG = ("customer", "part", "partsupp", "orders", "lineitem")
_APPENDS = 4
_CHILD_TIMEOUT_S = 3600.0
# Spark's default of 200 shuffle partitions is made for clusters; local[2] wants a few per core.
_SHUFFLE_PARTITIONS = 8


@dataclass(frozen=True)
class Query:
    name: str
    sql: str
    # Whether ORDER BY orders the rows totally (else they are compared sorted).
    ordered: bool


def queries(scale_factor: float) -> list[Query]:
    """The TPC-H queries run, in Spark SQL, with the spec's default substitution parameters.

    Q3 and Q10 (ORDER BY ... LIMIT) get a last ORDER BY key (the group's key), so the rows a
    LIMIT keeps are the same whatever order ties come in; Q11's FRACTION is 0.0001 / SF, as the
    spec says."""
    fraction = f"{0.0001 / scale_factor:.10f}"
    return [
        Query(
            "Q1",
            """
            select l_returnflag, l_linestatus,
                sum(l_quantity) as sum_qty,
                sum(l_extendedprice) as sum_base_price,
                sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
                sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
                avg(l_quantity) as avg_qty,
                avg(l_extendedprice) as avg_price,
                avg(l_discount) as avg_disc,
                count(*) as count_order
            from lineitem
            where l_shipdate <= date '1998-12-01' - interval '90' day
            group by l_returnflag, l_linestatus
            order by l_returnflag, l_linestatus
            """,
            True,
        ),
        Query(
            "Q3",
            """
            select l_orderkey, sum(l_extendedprice * (1 - l_discount)) as revenue,
                o_orderdate, o_shippriority
            from customer, orders, lineitem
            where c_mktsegment = 'BUILDING'
                and c_custkey = o_custkey
                and l_orderkey = o_orderkey
                and o_orderdate < date '1995-03-15'
                and l_shipdate > date '1995-03-15'
            group by l_orderkey, o_orderdate, o_shippriority
            order by revenue desc, o_orderdate, l_orderkey
            limit 10
            """,
            True,
        ),
        Query(
            "Q4",
            """
            select o_orderpriority, count(*) as order_count
            from orders
            where o_orderdate >= date '1993-07-01'
                and o_orderdate < date '1993-07-01' + interval '3' month
                and exists (
                    select * from lineitem
                    where l_orderkey = o_orderkey and l_commitdate < l_receiptdate
                )
            group by o_orderpriority
            order by o_orderpriority
            """,
            True,
        ),
        Query(
            "Q5",
            """
            select n_name, sum(l_extendedprice * (1 - l_discount)) as revenue
            from customer, orders, lineitem, supplier, nation, region
            where c_custkey = o_custkey
                and l_orderkey = o_orderkey
                and l_suppkey = s_suppkey
                and c_nationkey = s_nationkey
                and s_nationkey = n_nationkey
                and n_regionkey = r_regionkey
                and r_name = 'ASIA'
                and o_orderdate >= date '1994-01-01'
                and o_orderdate < date '1994-01-01' + interval '1' year
            group by n_name
            order by revenue desc
            """,
            False,
        ),
        Query(
            "Q6",
            """
            select sum(l_extendedprice * l_discount) as revenue
            from lineitem
            where l_shipdate >= date '1994-01-01'
                and l_shipdate < date '1994-01-01' + interval '1' year
                and l_discount between 0.06 - 0.01 and 0.06 + 0.01
                and l_quantity < 24
            """,
            True,
        ),
        Query(
            "Q10",
            """
            select c_custkey, c_name, sum(l_extendedprice * (1 - l_discount)) as revenue,
                c_acctbal, n_name, c_address, c_phone, c_comment
            from customer, orders, lineitem, nation
            where c_custkey = o_custkey
                and l_orderkey = o_orderkey
                and o_orderdate >= date '1993-10-01'
                and o_orderdate < date '1993-10-01' + interval '3' month
                and l_returnflag = 'R'
                and c_nationkey = n_nationkey
            group by c_custkey, c_name, c_acctbal, c_phone, n_name, c_address, c_comment
            order by revenue desc, c_custkey
            limit 20
            """,
            True,
        ),
        Query(
            "Q11",
            f"""
            select ps_partkey, sum(ps_supplycost * ps_availqty) as value
            from partsupp, supplier, nation
            where ps_suppkey = s_suppkey and s_nationkey = n_nationkey and n_name = 'GERMANY'
            group by ps_partkey
            having sum(ps_supplycost * ps_availqty) > (
                select sum(ps_supplycost * ps_availqty) * {fraction}
                from partsupp, supplier, nation
                where ps_suppkey = s_suppkey and s_nationkey = n_nationkey
                    and n_name = 'GERMANY'
            )
            order by value desc
            """,
            False,
        ),
        Query(
            "Q12",
            """
            select l_shipmode,
                sum(case when o_orderpriority = '1-URGENT' or o_orderpriority = '2-HIGH'
                    then 1 else 0 end) as high_line_count,
                sum(case when o_orderpriority <> '1-URGENT' and o_orderpriority <> '2-HIGH'
                    then 1 else 0 end) as low_line_count
            from orders, lineitem
            where o_orderkey = l_orderkey
                and l_shipmode in ('MAIL', 'SHIP')
                and l_commitdate < l_receiptdate
                and l_shipdate < l_commitdate
                and l_receiptdate >= date '1994-01-01'
                and l_receiptdate < date '1994-01-01' + interval '1' year
            group by l_shipmode
            order by l_shipmode
            """,
            True,
        ),
        Query(
            "Q13",
            """
            select c_count, count(*) as custdist
            from (
                select c_custkey, count(o_orderkey) as c_count
                from customer left outer join orders
                    on c_custkey = o_custkey and o_comment not like '%special%requests%'
                group by c_custkey
            ) as c_orders
            group by c_count
            order by custdist desc, c_count desc
            """,
            True,
        ),
        Query(
            "Q14",
            """
            select 100.00 * sum(case when p_type like 'PROMO%'
                    then l_extendedprice * (1 - l_discount) else 0 end)
                / sum(l_extendedprice * (1 - l_discount)) as promo_revenue
            from lineitem, part
            where l_partkey = p_partkey
                and l_shipdate >= date '1995-09-01'
                and l_shipdate < date '1995-09-01' + interval '1' month
            """,
            True,
        ),
        Query(
            "Q19",
            """
            select sum(l_extendedprice * (1 - l_discount)) as revenue
            from lineitem, part
            where (
                p_partkey = l_partkey
                and p_brand = 'Brand#12'
                and p_container in ('SM CASE', 'SM BOX', 'SM PACK', 'SM PKG')
                and l_quantity >= 1 and l_quantity <= 1 + 10
                and p_size between 1 and 5
                and l_shipmode in ('AIR', 'AIR REG')
                and l_shipinstruct = 'DELIVER IN PERSON'
            ) or (
                p_partkey = l_partkey
                and p_brand = 'Brand#23'
                and p_container in ('MED BAG', 'MED BOX', 'MED PKG', 'MED PACK')
                and l_quantity >= 10 and l_quantity <= 10 + 10
                and p_size between 1 and 10
                and l_shipmode in ('AIR', 'AIR REG')
                and l_shipinstruct = 'DELIVER IN PERSON'
            ) or (
                p_partkey = l_partkey
                and p_brand = 'Brand#34'
                and p_container in ('LG CASE', 'LG BOX', 'LG PACK', 'LG PKG')
                and l_quantity >= 20 and l_quantity <= 20 + 10
                and p_size between 1 and 15
                and l_shipmode in ('AIR', 'AIR REG')
                and l_shipinstruct = 'DELIVER IN PERSON'
            )
            """,
            True,
        ),
    ]


def systems() -> list[System]:
    return [
        System(PARQUET, BASELINE, lambda ctx: NoAdapter()),
        System(NATIVE, SUBJECT, lambda ctx: NoAdapter()),
        System(VERIFIED, SUBJECT, lambda ctx: NoAdapter()),
        System(BARE, BASELINE, lambda ctx: NoAdapter()),
    ]


# --- the data ----------------------------------------------------------------------------------


def generator() -> str | None:
    """The ``tpchgen-cli`` executable: next to this Python's (a venv's ``bin``), else on PATH."""
    here = Path(sys.executable).parent / GENERATOR
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(GENERATOR)


async def generate_or_skip(
    run: Run, scale_factor: float, out: Path
) -> tuple[dict[str, Path], float] | None:
    """TPC-H at ``scale_factor`` under ``out`` (``_generate``) and the seconds it took; None
    when ``tpchgen-cli`` is missing: then every system of ``run`` is recorded as skipped."""
    cli = generator()
    if cli is None:
        reason = f"{GENERATOR} is not installed; install the bench extra: pip install -e '.[bench]'"
        run.skipped += [{"system": s, "reason": reason} for s in run.names()]
        run.roles.clear()
        return None
    run.log(f"generating TPC-H at SF {scale_factor:g}")
    t0 = time.perf_counter()
    files = await asyncio.to_thread(_generate, cli, scale_factor, out)
    return files, time.perf_counter() - t0


def _generate(cli: str, scale_factor: float, out: Path) -> dict[str, Path]:
    """TPC-H at ``scale_factor`` as one Parquet file per table, by ``tpchgen-cli``."""
    cmd = [cli, "parquet", "-s", f"{scale_factor:g}", "-o", str(out), "-q"]
    subprocess.run(cmd, check=True, timeout=1800, capture_output=True)
    files = {t: out / f"{t}.parquet" for t in TABLES}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise RuntimeError(f"{GENERATOR} wrote no {missing}")
    return files


def shard_schema(schema: pa.Schema) -> pa.Schema:
    """The shard schema of a tpchgen table: its columns, ``string_view`` as ``string`` (persist
    sorts and compares plain strings; Spark sees both as strings), without Parquet field ids."""
    fields = [
        pa.field(f.name, pa.string() if f.type == pa.string_view() else f.type, f.nullable)
        for f in schema
    ]
    return pa.schema(fields)


def _chunks(path: Path, parts: int, schema: pa.Schema) -> Iterator[pa.Table]:
    """The rows of a Parquet file in ``parts`` tables of about equal size, cast to ``schema``
    (read a batch at a time: at most a chunk is held)."""
    file = pq.ParquetFile(path)
    per = max(1, -(-file.metadata.num_rows // parts))
    held: list[pa.RecordBatch] = []
    rows = 0
    for batch in file.iter_batches(batch_size=min(per, 65_536)):
        held.append(batch)
        rows += batch.num_rows
        if rows >= per:
            yield pa.Table.from_batches(held).cast(schema)
            held, rows = [], 0
    if held:
        yield pa.Table.from_batches(held).cast(schema)


async def _load(
    blob: str, consensus: str, files: dict[str, Path], log: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """Every table into its own new shard; by table: its shard, rows and appends."""
    out: dict[str, dict[str, Any]] = {}
    async with await persist.connect(blob, consensus) as client:
        for table, path in files.items():
            t0 = time.perf_counter()
            shard = str(persist.ShardId.new())
            schema = shard_schema(pq.read_schema(path))
            write = await client.open_writer(shard, schema, f"bench tpch {table}")
            rows = appends = 0
            for i, chunk in enumerate(_chunks(path, _APPENDS if table in _BIG else 1, schema)):
                stamped = chunk.append_column(
                    "_time", pa.array(np.full(chunk.num_rows, i, np.uint64))
                )
                await write.compare_and_append(stamped, i, i + 1)
                rows, appends = rows + chunk.num_rows, appends + 1
            await client.maintain(shard)
            await write.expire()
            expected = pq.ParquetFile(path).metadata.num_rows
            if rows != expected:
                raise RuntimeError(f"{table}: loaded {rows} of {expected} rows")
            out[table] = {"shard": shard, "rows": rows, "appends": appends}
            log(f"{table}: {rows} rows in {appends} appends, {time.perf_counter() - t0:.1f}s")
    return out


# --- the Spark child ---------------------------------------------------------------------------


def _native_frames(spark: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The persist tables as ``persist.spark.read`` DataFrames (Spark's Parquet reader)."""
    import persist.spark

    where = {"blob": spec["blob"], "consensus": spec["consensus"]}
    return {
        t: persist.spark.read(spark, shard=s["shard"], **where) for t, s in spec["tables"].items()
    }


def _release_native(frames: dict[str, Any]) -> None:
    import persist.spark

    for df in frames.values():
        persist.spark.release(df)


def _verified_frames(spark: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The persist tables through the ``persist`` Python data source."""
    where = {"blob": spec["blob"], "consensus": spec["consensus"]}
    return {
        t: spark.read.format("persist").options(shard=s["shard"], **where).load()
        for t, s in spec["tables"].items()
    }


def _parquet_frames(spark: Any, spec: dict[str, Any]) -> dict[str, Any]:
    return {t: spark.read.parquet(s["parquet"]) for t, s in spec["tables"].items()}


def _bare_frames(spark: Any, spec: dict[str, Any], parquet: dict[str, Any]) -> dict[str, Any]:
    """The tpchgen files through ``format("bare")`` (``benches/bare.py``), in the schemas Spark
    reads them in: the floor of any Python source, persist's ``format("persist")`` among them."""
    spark.dataSource.register(bare.source())
    return {
        t: spark.read.format("bare").schema(parquet[t].schema).option("path", s["parquet"]).load()
        for t, s in spec["tables"].items()
    }


def _input_bytes(frames: dict[str, Any]) -> dict[str, int]:
    """The files Spark reads for these DataFrames, and their bytes."""
    paths = {unquote(urlparse(f).path) for df in frames.values() for f in df.inputFiles()}
    return {"files": len(paths), "bytes": sum(os.path.getsize(p) for p in paths)}


def _answer(df: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
    """A query's answer: its column types and its rows (Decimals, dates, ints and strings
    compare exactly)."""
    types = [f"{f.name}:{f.dataType.simpleString()}" for f in df.schema]
    return types, [tuple(r) for r in df.collect()]


def _mismatch(
    query: Query, want: tuple[list[str], list[tuple[Any, ...]]], got: tuple[Any, ...]
) -> str | None:
    """Why ``got`` is not the answer ``want`` (the Parquet one), or ``None`` when it is."""
    (wtypes, wrows), (gtypes, grows) = want, got
    if wtypes != gtypes:
        return f"column types {gtypes} != {wtypes}"
    if len(wrows) != len(grows):
        return f"{len(grows)} rows != {len(wrows)}"
    if not query.ordered:
        wrows, grows = sorted(wrows, key=repr), sorted(grows, key=repr)
    for i, (w, g) in enumerate(zip(wrows, grows, strict=True)):
        if w != g:
            return f"row {i}: {g!r} != {w!r}"
    return None


def _spark_work(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a child process: one Spark session, the answer checks and the timed queries."""
    import persist.spark

    spark = local_spark(
        **{
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": str(_SHUFFLE_PARTITIONS),
        }
    )
    persist.spark.register(spark)
    qs = [q for q in queries(spec["scale_factor"]) if q.name in spec["queries"]]
    frames: dict[str, dict[str, Any]] = {}
    native: dict[str, Any] = {}
    try:
        frames[PARQUET] = _parquet_frames(spark, spec)
        frames[NATIVE] = native = _native_frames(spark, spec)
        frames[VERIFIED] = _verified_frames(spark, spec)
        frames[BARE] = _bare_frames(spark, spec, frames[PARQUET])

        def run(system: str, q: Query) -> tuple[float, tuple[list[str], list[tuple[Any, ...]]]]:
            for table, df in frames[system].items():
                df.createOrReplaceTempView(table)
            t0 = time.perf_counter()
            got = _answer(spark.sql(q.sql))
            return time.perf_counter() - t0, got

        # The warm-up (JVM, Python workers, page cache) is also the answer check.
        answers: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
        checks: dict[str, dict[str, Any]] = {}
        wrong: list[str] = []
        warm: dict[str, dict[str, list[float]]] = {s: {} for s in frames}
        for q in qs:
            dt, answers[q.name] = run(PARQUET, q)
            warm[PARQUET][q.name] = [dt]
            checks[q.name] = {"rows": len(answers[q.name][1])}
            for system in frames:
                if system != PARQUET:
                    dt, got = run(system, q)
                    warm[system][q.name] = [dt]
                    why = _mismatch(q, answers[q.name], got)
                    checks[q.name][system] = "equal" if why is None else f"DIFFERENT: {why}"
                    if why is not None:
                        wrong.append(f"{q.name} {system}: {why}")
        if wrong:
            raise RuntimeError("answers differ from Parquet's:\n  " + "\n  ".join(wrong))
        # With no timed round (the smoke scale, which proves the paths, not the speed), the
        # warm-up's times stand in.
        seconds: dict[str, dict[str, list[float]]] = (
            {s: {q.name: [] for q in qs} for s in frames} if spec["repeats"] else warm
        )
        deadline = time.monotonic() + spec["budget_s"]
        for rep in range(spec["repeats"]):
            if rep and time.monotonic() >= deadline:
                break
            for q in qs:
                for system in frames:
                    dt, got = run(system, q)
                    why = _mismatch(q, answers[q.name], got)
                    if why is not None:
                        raise RuntimeError(f"{q.name} {system}, round {rep + 1}: {why}")
                    seconds[system][q.name].append(dt)
        by_name = {q.name: q for q in qs}

        def run_views(name: str, views: dict[str, Any]) -> tuple[float, bool]:
            for table, df in views.items():
                df.createOrReplaceTempView(table)
            t0 = time.perf_counter()
            got = _answer(spark.sql(by_name[name].sql))
            return time.perf_counter() - t0, _mismatch(by_name[name], answers[name], got) is None

        writes = lineitem_writes(spark, spec, run_views, set(by_name), Path(spec["scratch"]))
        inputs = {s: _input_bytes(frames[s]) for s in (PARQUET, NATIVE) if s in frames}
        for system, by_table in frames.items():
            partitions = by_table["lineitem"].rdd.getNumPartitions()
            inputs.setdefault(system, {})["lineitem_partitions"] = partitions
    finally:
        try:
            if native:
                _release_native(native)
        finally:
            spark.stop()
    return {"seconds": seconds, "checks": checks, "inputs": inputs, "writes": writes}


# --- the scenario ------------------------------------------------------------------------------


def _geomean(values: list[float | None]) -> float | None:
    if not values or any(v is None or v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values if v is not None) / len(values))


def _writes(
    run: Run, w: dict[str, Any], repeats: int
) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """The lineitem writes' table (rows/s of each system; the fresh read's query seconds), its
    title, and their ratios: persist's write and the bare sink's vs Parquet's, and each fresh
    query's native read vs Parquet's."""
    rows = w["rows"]

    def rate(seconds: float) -> float:
        return rows / seconds

    fresh = {
        system: {
            f"fresh_{q}_s": w[f"fresh_{label}_{q}_s"]
            for q in FRESH_QUERIES
            if f"fresh_{label}_{q}_s" in w
        }
        for system, label in ((PARQUET, "parquet"), (NATIVE, "native"))
    }
    wrong = [k for k, v in w.items() if k.endswith("_right") and not v]
    if wrong:
        raise RuntimeError(f"a fresh read's answer differs from Parquet's: {wrong}")
    table = {
        PARQUET: run.row(
            PARQUET, rows_per_s=rate(w["parquet_s"]), files=w["parquet_files"], **fresh[PARQUET]
        ),
        VERIFIED: run.row(VERIFIED, rows_per_s=rate(w["persist_s"]), parts=w["persist_parts"]),
        NATIVE: run.row(NATIVE, **fresh[NATIVE]),
        BARE: run.row(BARE, rows_per_s=rate(w["bare_s"])),
    }
    title = (
        f"lineitem written by Spark ({rows:,} rows, 16 columns), best of {max(1, repeats)}: "
        "rows/s, and the files or parts it made; then Q1 and Q6 over what the last write made, "
        "at once (persist native: persist.spark.read of the shard just written), s"
    )
    ratios = [
        entry(
            'Spark write of lineitem, df.write.format("persist") vs df.write.parquet',
            ratio(w["parquet_s"], w["persist_s"]),
            "rows/s(persist) / rows/s(parquet)",
            at_least=0.9,
        ),
        entry(
            "Spark write of lineitem, bare Python sink vs df.write.parquet (the ceiling of any "
            "Python sink)",
            ratio(w["parquet_s"], w["bare_s"]),
            "rows/s(bare python sink) / rows/s(parquet)",
        ),
    ]
    for q in FRESH_QUERIES:
        if f"fresh_native_{q}_s" in w:
            ratios.append(
                entry(
                    f"native read right after the Spark write vs parquet's files, {q}",
                    ratio(w[f"fresh_parquet_{q}_s"], w[f"fresh_native_{q}_s"]),
                    f"queries/s(persist native, fresh shard) / queries/s(parquet), {q}",
                    at_least=0.9,
                )
            )
    return table, title, ratios


async def run(ctx: Context) -> dict[str, Any]:
    scale = ctx.scale
    sf = scale.tpch_scale_factor
    blob = f"file://{ctx.workdir / 'blob'}"
    consensus = ctx.postgres_uri
    qs = [q for q in queries(sf) if not scale.tpch_queries or q.name in scale.tpch_queries]
    params = {
        "scale_factor": sf,
        "repeats": scale.tpch_repeats,
        "rounds_budget_s": scale.tpch_budget_s,
        "appends": f"{_APPENDS} for {', '.join(_BIG)}; 1 for the others",
        "master": "local[2]",
        "shuffle_partitions": _SHUFFLE_PARTITIONS,
        "queries": [q.name for q in qs],
    }
    async with Run(ctx, NAME, systems()) as run:
        generated = await generate_or_skip(run, sf, ctx.workdir / "parquet")
        if generated is None:
            return await run.result(params=params, tables={}, ratios=[])
        files, generated_s = generated
        loaded = await _load(blob, consensus, files, run.log)
        run.log("spark session (child process)")
        spec = {
            "blob": blob,
            "consensus": consensus,
            "tables": {t: {**loaded[t], "parquet": str(files[t])} for t in TABLES},
            "scale_factor": sf,
            "queries": [q.name for q in qs],
            "repeats": scale.tpch_repeats,
            "budget_s": scale.tpch_budget_s,
            "scratch": str(ctx.workdir / "writes"),
        }
        s = await asyncio.to_thread(run_in_child, _spark_work, spec, _CHILD_TIMEOUT_S)
    seconds: dict[str, dict[str, list[float]]] = s["seconds"]
    best = {system: {q: min(xs) for q, xs in by_q.items()} for system, by_q in seconds.items()}
    names = [q.name for q in qs]
    rounds = min(len(xs) for by_q in seconds.values() for xs in by_q.values())
    query_rows = {
        system: run.row(
            system,
            **{f"{q}_s": best[system][q] for q in names},
            geomean_s=_geomean([best[system][q] for q in names]),
            rounds=rounds,
        )
        for system in best
    }
    ratios: list[dict[str, Any]] = []
    for system, label, target in ((NATIVE, "native", 0.8), (VERIFIED, "verified", 0.5)):
        per_query = {q: ratio(best[PARQUET][q], best[system][q]) for q in names if system in best}
        ratios.append(
            entry(
                f"persist {label} vs parquet, geometric mean over {len(names)} queries",
                _geomean(list(per_query.values())) if per_query else None,
                "geomean over queries of time(parquet) / time(persist " + label + ")",
                at_least=target,
            )
        )
        ratios += [
            entry(
                f"persist {label} vs parquet, {q}",
                v,
                f"queries/s(persist {label}) / queries/s(parquet)",
            )
            for q, v in per_query.items()
        ]
    if BARE in best:
        # What no Python source passes on this Spark, and where format("persist") stands to it.
        floor = {q: ratio(best[PARQUET][q], best[BARE][q]) for q in names}
        ratios.append(
            entry(
                f"bare Python source vs parquet, geometric mean over {len(names)} queries "
                "(the ceiling of any Python source)",
                _geomean(list(floor.values())),
                "geomean over queries of time(parquet) / time(bare python source)",
            )
        )
        ratios.append(
            entry(
                "persist verified vs the bare Python source, geometric mean",
                _geomean([ratio(best[BARE][q], best[VERIFIED][q]) for q in names]),
                "geomean over queries of time(bare python source) / time(persist verified)",
            )
        )
    writes, write_table, write_ratios = _writes(run, s["writes"], scale.tpch_repeats)
    ratios += write_ratios
    inputs = s["inputs"]
    tables: dict[str, Any] = {
        (
            f"query time, s (best of {rounds} round(s), after a warm-up)"
            if scale.tpch_repeats
            else "query time, s (the warm-up alone: no timed round at this scale)"
        ): query_rows,
        "answers (rows of the Parquet answer; each persist answer vs it)": s["checks"],
        "data": {
            PARQUET: run.row(
                PARQUET,
                generate_s=generated_s,
                rows=sum(v["rows"] for v in loaded.values()),
                **inputs.get(PARQUET, {}),
            ),
            **{n: run.row(n, **inputs[n]) for n in (NATIVE, VERIFIED) if n in inputs},
        },
    }
    tables[write_table] = writes
    if "bytes" in inputs.get(NATIVE, {}):
        ratios.append(
            entry(
                "input file bytes, persist native vs parquet (all tables)",
                ratio(inputs[NATIVE]["bytes"], inputs[PARQUET]["bytes"]),
                "bytes(persist part files read) / bytes(tpchgen Parquet files)",
            )
        )
    return await run.result(
        params=params,
        tables=tables,
        ratios=ratios,
        checks=s["checks"],
        seconds=seconds,
        loaded=loaded,
        notes=[
            "one Spark session (local[2]) in a child process; each query runs once per system "
            "untimed (the answer check), then in interleaved timed rounds; a time is the best "
            "round",
            "every persist answer equals the Parquet answer: column types, and rows compared "
            "exactly (decimals as decimals), sorted first where ORDER BY is not total (Q5, Q11)",
            "Q3 and Q10 order by their group key last, so LIMIT keeps the same rows under ties",
            f"{BARE}: tpchgen's files through a Python source that only hands Spark their row "
            "groups as Arrow batches (2 partitions): Spark 4.3 prunes no column of a Python "
            "source, so every column of every row crosses to the JVM; no Python source is "
            "faster here, and persist verified is set against it too",
            "the shards hold tpchgen's columns with string_view as string; Parquet's data is "
            f"{GENERATOR}'s own files",
            "input file bytes: the files Spark's plan reads (DataFrame.inputFiles), persist's "
            "part files with their _time and _diff columns; lineitem_partitions: the input "
            "partitions of a scan of lineitem (tpchgen writes one file per table, persist a part "
            "per append or compaction: Spark splits them differently over the 2 cores)",
        ],
    )
