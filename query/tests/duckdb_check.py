#!/usr/bin/env python3
"""Opens the persisted Parquet files of an Apron data directory with DuckDB, as a user
would (Hive partitions on), and checks what it sees against the table contract.

Usage: python3 query/tests/duckdb_check.py DATA_DIR   (pip install duckdb)

Prints each table's columns with DuckDB's types, the row count per `date=` partition and
a sample aggregate; exits non-zero when a column has the wrong type, a file cannot be
read, or no table is found.
"""
import pathlib
import sys

import duckdb

# Column → DuckDB type, for the columns whose storage type the contract pins down.
EXPECTED = {
    "gpu_samples": {
        "time": "TIMESTAMP WITH TIME ZONE",
        "window_s": "DOUBLE",
        "host": "VARCHAR",
        "gpu_uuid": "VARCHAR",
        "gpu_index": "INTEGER",
        "gpu_util": "DECIMAL(5,4)",
        "gpu_util_max": "DECIMAL(5,4)",
        "sm_active": "DECIMAL(5,4)",
        "power_watts": "DECIMAL(9,3)",
        "energy_joules": "DECIMAL(18,3)",
        "gpu_temp_c": "INTEGER",
        "fb_used_bytes": "BIGINT",
        "pcie_tx_bytes_per_s": "BIGINT",
        "date": "DATE",  # the Hive partition column, as DuckDB infers it
    },
    "gpu_processes": {
        "time": "TIMESTAMP WITH TIME ZONE",
        "gpu_uuid": "VARCHAR",
        "pid": "BIGINT",
        "sm_util": "DECIMAL(5,4)",
        "fb_used_bytes": "BIGINT",
    },
}


def main(root: pathlib.Path) -> int:
    errors = []
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    seen = 0
    for table, expected in EXPECTED.items():
        if not list((root / table).glob("date=*/*.parquet")):
            print(f"== {table}: no files")
            continue
        seen += 1
        src = f"read_parquet('{root / table}/*/*.parquet', hive_partitioning = true)"
        cols = con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()
        types = {name: typ for name, typ, *_ in cols}
        print(f"== {table}: {len(cols)} columns")
        for name, typ, *_ in cols:
            print(f"  {name:32} {typ}")
        for name, want in expected.items():
            got = types.get(name)
            if got != want:
                errors.append(f"{table}.{name}: DuckDB type {got}, expected {want}")
        total = con.execute(f"SELECT count(*) FROM {src}").fetchone()[0]
        print(f"  rows: {total}")
        for date, n in con.execute(f"SELECT date, count(*) FROM {src} GROUP BY date ORDER BY date").fetchall():
            print(f"    date={date}: {n}")
        if table == "gpu_samples":
            row = con.execute(
                f"SELECT count(DISTINCT gpu_uuid), min(time), max(time), avg(gpu_util), max(power_watts) FROM {src}"
            ).fetchone()
            print(f"  gpus={row[0]} time=[{row[1]}, {row[2]}] avg(gpu_util)={row[3]} max(power_watts)={row[4]}")
    if seen == 0:
        errors.append(f"no tables under {root}")
    for e in errors:
        print("ERROR:", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(pathlib.Path(sys.argv[1]).resolve()))
