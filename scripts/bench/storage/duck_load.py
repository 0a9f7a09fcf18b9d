#!/usr/bin/env python3
"""Loads Apron's persisted gpu_samples Parquet files into a DuckDB database file.

    duck_load.py APRON_DATA_DIR DBFILE

The same rows and values Apron stores (DuckDB keeps the DECIMAL/INT types of the
Parquet files), in one native table; CHECKPOINT so the file holds everything. Prints
JSON: seconds for CREATE TABLE + CHECKPOINT, rows.
"""

import json
import os
import sys
import time

import duckdb


def main():
    data, dbfile = sys.argv[1], sys.argv[2]
    for p in (dbfile, dbfile + ".wal"):
        if os.path.exists(p):
            os.remove(p)
    con = duckdb.connect(dbfile)
    t0 = time.perf_counter()
    con.execute(
        "CREATE TABLE gpu_samples AS SELECT * FROM read_parquet(?, hive_partitioning = false)",
        [os.path.join(data, "gpu_samples", "**", "*.parquet")],
    )
    con.execute("CHECKPOINT")
    seconds = time.perf_counter() - t0
    rows = con.execute("SELECT count(*) FROM gpu_samples").fetchone()[0]
    con.close()
    json.dump({"load_s": seconds, "rows": rows, "duckdb": duckdb.__version__}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
