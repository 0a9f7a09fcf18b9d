#!/usr/bin/env python3
"""PostgreSQL clients against Apron's pg port: psql meta-commands (and psql 16's
`\\bind`), psycopg 3 with server-side parameters, asyncpg (prepared statements, a
portal read in pieces), SQLAlchemy's inspector and pandas.read_sql, and the SQL
Grafana's PostgreSQL data source sends. Prints one JSON object of what each client saw,
for the Rust test (server/tests/server/pg_clients.rs) to check.

usage: clients.py PORT USER PASSWORD GPU FROM_S TO_S   (the trace's time range, Unix s)

Exit 2 when a client library is missing (a failure, never a skip: the test scripts
install them)."""

import asyncio
import datetime
import importlib.util
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


# psql 16 for \bind (Debian 12's psql is 15): the one in pgserver's wheel, found without
# importing pgserver (which would set up its own server directories).
_PGSERVER = importlib.util.find_spec("pgserver")
if _PGSERVER is None:  # pragma: no cover
    print("missing client library: pgserver (for psql 16)", file=sys.stderr)
    sys.exit(2)
PSQL16 = os.path.join(_PGSERVER.submodule_search_locations[0], "pginstall", "bin", "psql")


def psql(port, user, password, command, binary="psql"):
    """One psql command; a script on stdin when it mixes SQL and backslash commands."""
    env = dict(os.environ, PGPASSWORD=password, PGCONNECT_TIMEOUT="10", PGSSLMODE="disable")
    args = [binary, "-h", "127.0.0.1", "-p", str(port), "-U", user, "-d", "apron", "-X", "-A", "-t"]
    script = "\\" in command[1:]
    o = subprocess.run(
        args + (["-v", "ON_ERROR_STOP=1", "-f", "-"] if script else ["-c", command]),
        input=command if script else None,
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
        inspector = sqlalchemy.inspect(engine)
        out = {"tables": sorted(inspector.get_table_names())}
        out["columns"] = [[c["name"], str(c["type"])] for c in inspector.get_columns("gpu_cost_hourly")]
        df = pandas.read_sql(
            sqlalchemy.text("SELECT gpu_uuid, count(*) AS n FROM gpu_samples WHERE gpu_uuid = :gpu GROUP BY gpu_uuid"),
            engine,
            params={"gpu": gpu},
        )
        out["pandas"] = df.to_dict(orient="records")
        return out
    finally:
        engine.dispose()


# Grafana's PostgreSQL data source (grafana-postgresql-datasource): the queries of its
# configuration page and its schema, table and column pickers (postgresMetaQuery.ts),
# and a panel's query after its macros are expanded (macros.go). Its backend speaks
# through pgx, which prepares every statement (Parse/Describe/Bind/Execute).
ON_SEARCH_PATH = """
          quote_ident(table_schema) IN (
          SELECT
            CASE WHEN trim(s[i]) = '"$user"' THEN user ELSE trim(s[i]) END
          FROM
            generate_series(
              array_lower(string_to_array(current_setting('search_path'),','),1),
              array_upper(string_to_array(current_setting('search_path'),','),1)
            ) as i,
            string_to_array(current_setting('search_path'),',') s
          )"""
GRAFANA_META = {
    "version": "SELECT current_setting('server_version_num')::int/100 as version",
    "timescaledb": "SELECT extversion FROM pg_extension WHERE extname = 'timescaledb'",
    "schemas": """SELECT schema_name AS "name"
    FROM information_schema.schemata
    WHERE schema_name NOT IN ('information_schema', 'pg_catalog', 'pg_toast', '_timescaledb_cache',
                              '_timescaledb_catalog', '_timescaledb_internal', '_timescaledb_config',
                              'timescaledb_information', 'timescaledb_experimental')
    ORDER BY schema_name""",
    "tables": f"""SELECT
    CASE WHEN {ON_SEARCH_PATH}
      THEN quote_ident(table_name)
      ELSE quote_ident(table_schema) || '.' || quote_ident(table_name)
    END AS "table"
    FROM information_schema.tables
    WHERE quote_ident(table_schema) NOT IN ('information_schema', 'pg_catalog', '_timescaledb_cache',
                             '_timescaledb_catalog', '_timescaledb_internal', '_timescaledb_config',
                             'timescaledb_information', 'timescaledb_experimental')
    ORDER BY CASE WHEN {ON_SEARCH_PATH} THEN 0 ELSE 1 END, 1""",
    "columns": f"""SELECT quote_ident(column_name) AS "column", data_type AS "type"
    FROM information_schema.columns
    WHERE
      CASE WHEN array_length(parse_ident('gpu_samples'),1) = 2
        THEN quote_ident(table_schema) = (parse_ident('gpu_samples'))[1]
          AND quote_ident(table_name) = (parse_ident('gpu_samples'))[2]
        ELSE quote_ident(table_name) = 'gpu_samples'
          AND {ON_SEARCH_PATH}
      END""",
}


def rfc3339(seconds):
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_grafana(port, user, password, gpu, t_from, t_to):
    out = {}
    with psycopg.connect(host="127.0.0.1", port=port, user=user, password=password, dbname="apron",
                         sslmode="disable", autocommit=True) as c:
        for name, sql in GRAFANA_META.items():
            try:
                out[name] = [list(r) for r in c.execute(sql, prepare=True).fetchall()]
            except psycopg.Error as e:
                out[name] = {"error": str(e)}
        # SELECT $__timeGroupAlias(time, '10m'), … WHERE $__timeFilter(time) AND gpu_uuid = '…'
        time_filter = f"time BETWEEN '{rfc3339(t_from)}' AND '{rfc3339(t_to)}'"
        panel = (f"SELECT floor(extract(epoch from time)/600)*600 AS \"time\", count(*) AS windows, "
                 f"avg(gpu_util) AS gpu_util FROM gpu_samples WHERE {time_filter} AND gpu_uuid = '{gpu}' "
                 f"GROUP BY 1 ORDER BY 1")
        out["panel"] = [[float(t), n] for t, n, _ in c.execute(panel, prepare=True).fetchall()]
        # The idle cost by team, a finance panel: $__timeFilter(hour).
        cost = (f"SELECT hour AS \"time\", team, sum(idle_cost_usd) AS idle_usd FROM gpu_cost_hourly "
                f"WHERE hour BETWEEN '{rfc3339(t_from)}' AND '{rfc3339(t_to)}' GROUP BY 1, 2 ORDER BY 1, 2")
        out["cost_teams"] = sorted({r[1] for r in c.execute(cost, prepare=True).fetchall()})
    return out


def main():
    port, user, password, gpu = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    t_from, t_to = int(sys.argv[5]), int(sys.argv[6])
    bind = f"SELECT count(*) FROM gpu_samples WHERE gpu_uuid = $1 AND window_s > $2 \\bind {gpu} 0.5 \\g"
    result = {
        "psql": {cmd: psql(port, user, password, cmd) for cmd in ["\\dt", "\\d gpu_samples", "\\l", "\\dn"]},
        "psql16_bind": psql(port, user, password, bind, binary=PSQL16),
        "grafana": with_grafana(port, user, password, gpu, t_from, t_to),
        "psycopg": with_psycopg(port, user, password, gpu),
        "asyncpg": asyncio.run(with_asyncpg(port, user, password, gpu)),
        "sqlalchemy": with_sqlalchemy(port, user, password, gpu),
    }
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
