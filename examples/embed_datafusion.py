"""Embedding `MemWalTable` in another DataFusion program: a MemWAL table is one more table provider
next to Parquet files and in-memory data, in SQL and in the DataFrame API, and joins with them.

Usage: python examples/embed_datafusion.py [DIRECTORY]   (default: a temporary directory, removed afterwards)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import datafusion
import pyarrow as pa
import pyarrow.parquet as pq
from datafusion import col, functions, lit

import memwal_df as mw


def main(directory: str | None = None) -> int:
    if directory is None:  # a temporary directory, removed afterwards
        with tempfile.TemporaryDirectory(prefix="memwal-embed-") as tmp:
            return main(tmp)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    # Customers: a MemWAL table that receives upserts.
    customers = mw.create_table(
        str(root / "customers"),
        pa.table({"id": pa.array([1, 2, 3], pa.int64()), "country": ["DE", "FR", "DE"]}),
        primary_key="id",
        region_spec=mw.bucket("id", 2),
    )
    with customers.writer() as w:
        w.put(pa.table({"id": pa.array([2, 4], pa.int64()), "country": ["DE", "IT"]}))  # 2 moved to DE
    # Orders: a plain Parquet file; exchange rates: in-memory Arrow data.
    orders = pa.table(
        {"customer": pa.array([1, 2, 2, 3, 4], pa.int64()), "amount": [10.0, 5.0, 7.0, 1.0, 4.0]}
    )
    pq.write_table(orders, root / "orders.parquet")
    rates = pa.table({"country": ["DE", "FR", "IT"], "eur": [1.0, 1.0, 1.0]})

    ctx = mw.register(datafusion.SessionContext())  # memwal_df's SQL functions on your own context
    ctx.register_table("customers", mw.MemWalTable(str(root / "customers")))
    ctx.register_parquet("orders", str(root / "orders.parquet"))
    ctx.register_record_batches("rates", [rates.to_batches()])

    by_sql = ctx.sql(
        "SELECT c.country, sum(o.amount * r.eur) AS revenue FROM orders o "
        "JOIN customers c ON o.customer = c.id JOIN rates r ON r.country = c.country "
        "GROUP BY c.country ORDER BY c.country"
    ).to_pylist()
    by_frame = (
        ctx.table("customers")
        .filter(col("country") == lit("DE"))
        .aggregate([], [functions.count(col("id")).alias("n")])
        .to_pylist()
    )
    print("revenue by country:", by_sql)
    print("customers in DE:", by_frame)

    # The same answer computed without DataFusion: the customers' newest versions, joined by hand.
    country = {1: "DE", 2: "DE", 3: "DE", 4: "IT"}
    revenue: dict[str, float] = {}
    for cust, amount in zip(orders["customer"].to_pylist(), orders["amount"].to_pylist(), strict=True):
        revenue[country[cust]] = revenue.get(country[cust], 0.0) + amount
    expected = [{"country": k, "revenue": v} for k, v in sorted(revenue.items())]
    n_de = sum(1 for c in country.values() if c == "DE")
    return 0 if by_sql == expected and by_frame == [{"n": n_de}] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
