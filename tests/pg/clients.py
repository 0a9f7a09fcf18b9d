#!/usr/bin/env python3
"""PostgreSQL clients against Apron's pg port: psql meta-commands, psycopg 3 with
server-side parameters, asyncpg (prepared statements, a portal read in pieces),
SQLAlchemy's inspector and pandas.read_sql. Prints one JSON object of what each client
saw, for the Rust test (server/tests/server/pg_clients.rs) to check.

usage: clients.py PORT USER PASSWORD GPU

Exit 2 when a client library is missing (a failure, never a skip: the test scripts
install them)."""

import asyncio
import json
import os
import subprocess
import sys

try:
    import asyncpg
    import pandas
    import psycopg
    import sqlalchemy
except ImportError as e:  # pragma: no cover
    print(f"missing client library: {e}", file=sys.stderr)
    sys.exit(2)


def psql(port, user, password, command):
    env = dict(os.environ, PGPASSWORD=password, PGCONNECT_TIMEOUT="10", PGSSLMODE="disable")
    o = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", str(port), "-U", user, "-d", "apron", "-X", "-A", "-t", "-c", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if o.returncode != 0:
        return {"error": o.stderr.strip()}
    return {"lines": [l for l in o.stdout.splitlines() if l]}


def with_psycopg(port, user, password, gpu):
    out = {}
    with psycopg.connect(host="127.0.0.1", port=port, user=user, password=password, dbname="apron",
                         sslmode="disable", autocommit=True) as c:
        # Server-side binding (Parse/Bind/Execute), prepared on the server.
        cur = c.execute("SELECT count(*) FROM gpu_samples WHERE gpu_uuid = %s AND window_s > %s", (gpu, 0.5),
                        prepare=True)
        out["count"] = cur.fetchone()[0]
        cur = c.execute("SELECT count(*) FROM gpu_samples WHERE gpu_uuid = %s AND window_s > %s", (gpu, 0.5),
                        prepare=True)
        out["count_again"] = cur.fetchone()[0]
        cur = c.execute("SELECT DISTINCT team FROM allocations ORDER BY team", prepare=True)
        out["teams"] = [r[0] for r in cur.fetchall()]
        try:
            c.execute("DELETE FROM gpu_samples WHERE gpu_uuid = %s", (gpu,), prepare=True)
            out["write"] = "accepted"
        except psycopg.Error as e:
            out["write"] = e.sqlstate
        try:
            c.execute("SELECT nonexistent FROM gpu_samples WHERE gpu_uuid = %s", (gpu,), prepare=True)
        except psycopg.Error as e:
            out["bad_column"] = e.sqlstate
    return out


async def with_asyncpg(port, user, password, gpu):
    conn = await asyncpg.connect(host="127.0.0.1", port=port, user=user, password=password, database="apron",
                                 ssl=False)
    try:
        out = {}
        stmt = await conn.prepare("SELECT gpu_uuid, count(*) AS n FROM gpu_samples WHERE gpu_uuid = $1 GROUP BY gpu_uuid")
        out["param_types"] = [t.name for t in stmt.get_parameters()]
        out["columns"] = [a.name for a in stmt.get_attributes()]
        rows = await stmt.fetch(gpu)
        out["rows"] = [[r["gpu_uuid"], r["n"]] for r in rows]
        # A portal read two rows at a time (Execute with a row limit, PortalSuspended).
        seen = []
        async with conn.transaction():
            async for r in conn.cursor("SELECT gpu_uuid FROM gpu_samples WHERE window_s > $1 ORDER BY time, gpu_uuid LIMIT 7",
                                       0.5, prefetch=2):
                seen.append(r["gpu_uuid"])
        out["cursor_rows"] = len(seen)
        return out
    finally:
        await conn.close()


def with_sqlalchemy(port, user, password, gpu):
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://{user}:{password}@127.0.0.1:{port}/apron?sslmode=disable")
    try:
        out = {"tables": sorted(sqlalchemy.inspect(engine).get_table_names())}
        df = pandas.read_sql(
            sqlalchemy.text("SELECT gpu_uuid, count(*) AS n FROM gpu_samples WHERE gpu_uuid = :gpu GROUP BY gpu_uuid"),
            engine,
            params={"gpu": gpu},
        )
        out["pandas"] = df.to_dict(orient="records")
        return out
    finally:
        engine.dispose()


def main():
    port, user, password, gpu = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    result = {
        "psql": {cmd: psql(port, user, password, cmd) for cmd in ["\\dt", "\\d gpu_samples", "\\l", "\\dn"]},
        "psycopg": with_psycopg(port, user, password, gpu),
        "asyncpg": asyncio.run(with_asyncpg(port, user, password, gpu)),
        "sqlalchemy": with_sqlalchemy(port, user, password, gpu),
    }
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
