// The PostgreSQL JDBC driver (Debian's libpostgresql-jdbc-java: what Metabase, DBeaver
// and Tableau embed) against Apron's pg port: DatabaseMetaData as schema browsers read
// it, the statements Metabase and DBeaver send on connect, a PreparedStatement with
// typed parameters run past the driver's prepareThreshold (unnamed, then named
// server-side statements), a cursor read in pieces (Execute with a row limit), and a
// refused write. Prints one JSON object for server/tests/server/pg_clients.rs.
//
// usage: java -cp /usr/share/java/postgresql.jar tests/pg/Jdbc.java PORT USER PASSWORD GPU FROM_S TO_S

import java.sql.Connection;
import java.sql.DatabaseMetaData;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.sql.Timestamp;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;

public class Jdbc {
    /** Said on connect by Metabase (v0.55) and DBeaver (25.1) before they browse. */
    static final String[][] ON_CONNECT = {
        {"metabase", "SET extra_float_digits = 2"},
        {"metabase", "SHOW TRANSACTION ISOLATION LEVEL"},
        {"metabase", "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ UNCOMMITTED"},
        {"metabase", "SELECT n.nspname AS schema, c.relname AS name, CASE c.relkind WHEN 'r' THEN 'TABLE'"
            + " WHEN 'v' THEN 'VIEW' ELSE NULL END AS type, d.description AS description,"
            + " stat.n_live_tup AS estimated_row_count FROM pg_catalog.pg_class AS c"
            + " INNER JOIN pg_catalog.pg_namespace AS n ON c.relnamespace = n.oid"
            + " LEFT JOIN pg_catalog.pg_description AS d ON c.oid = d.objoid AND d.objsubid = 0"
            + " AND d.classoid = 'pg_class'::regclass"
            + " LEFT JOIN pg_stat_user_tables AS stat ON n.nspname = stat.schemaname AND c.relname = stat.relname"
            + " WHERE n.nspname !~ '^pg_' AND n.nspname <> 'information_schema'"
            + " AND c.relkind IN ('r', 'p', 'v', 'f', 'm') AND n.nspname IN ('public') ORDER BY type, schema, name"},
        {"metabase", "SHOW timezone"},
        {"dbeaver", "SELECT current_schema(), session_user"},
        {"dbeaver", "SELECT n.oid, n.*, d.description FROM pg_catalog.pg_namespace n"
            + " LEFT OUTER JOIN pg_catalog.pg_description d ON d.objoid = n.oid AND d.objsubid = 0"
            + " AND d.classoid = 'pg_namespace'::regclass ORDER BY nspname"},
        {"dbeaver", "SHOW search_path"},
        {"dbeaver", "SELECT db.oid, db.* FROM pg_catalog.pg_database db WHERE datname = current_database()"},
    };

    public static void main(String[] args) throws Exception {
        String url = "jdbc:postgresql://127.0.0.1:" + args[0] + "/apron";
        String gpu = args[3];
        Timestamp from = new Timestamp(Long.parseLong(args[4]) * 1000L);
        Timestamp to = new Timestamp(Long.parseLong(args[5]) * 1000L);
        Map<String, Object> out = new LinkedHashMap<>();
        Properties props = new Properties();
        props.setProperty("user", args[1]);
        props.setProperty("password", args[2]);
        props.setProperty("sslmode", "disable");
        props.setProperty("ApplicationName", "Metabase v0.55.1");
        props.setProperty("connectTimeout", "10");
        props.setProperty("socketTimeout", "60");
        try (Connection c = DriverManager.getConnection(url, props)) {
            DatabaseMetaData md = c.getMetaData();
            out.put("product", md.getDatabaseProductName() + " " + md.getDatabaseMajorVersion());
            List<String> tables = new ArrayList<>();
            try (ResultSet rs = md.getTables(null, "public", "%", new String[] {"TABLE", "VIEW"})) {
                while (rs.next()) tables.add(rs.getString("TABLE_NAME"));
            }
            out.put("tables", tables);
            List<String> schemas = new ArrayList<>();
            try (ResultSet rs = md.getSchemas()) {
                while (rs.next()) schemas.add(rs.getString("TABLE_SCHEM"));
            }
            out.put("schemas", schemas);
            List<String> columns = new ArrayList<>();
            try (ResultSet rs = md.getColumns(null, "public", "gpu_samples", "%")) {
                while (rs.next()) columns.add(rs.getString("COLUMN_NAME") + " " + rs.getString("TYPE_NAME"));
            }
            out.put("columns", columns);

            Map<String, Object> onConnect = new LinkedHashMap<>();
            for (String[] q : ON_CONNECT) {
                try (Statement s = c.createStatement()) {
                    boolean rows = s.execute(q[1]);
                    int n = 0;
                    if (rows) try (ResultSet rs = s.getResultSet()) { while (rs.next()) n++; }
                    onConnect.put(q[0] + ": " + q[1], n);
                } catch (SQLException e) {
                    onConnect.put(q[0] + ": " + q[1], "error " + e.getSQLState() + " " + e.getMessage());
                }
            }
            out.put("on_connect", onConnect);

            // Six runs: the driver's prepareThreshold (5) turns the unnamed statement
            // into a named one that later runs bind again.
            List<Long> counts = new ArrayList<>();
            try (PreparedStatement ps = c.prepareStatement(
                    "SELECT count(*) FROM gpu_samples WHERE gpu_uuid = ? AND window_s > ? AND time > ? AND time <= ?")) {
                for (int i = 0; i < 6; i++) {
                    ps.setString(1, gpu);
                    ps.setDouble(2, 0.5);
                    ps.setTimestamp(3, from);
                    ps.setTimestamp(4, to);
                    try (ResultSet rs = ps.executeQuery()) {
                        rs.next();
                        counts.add(rs.getLong(1));
                    }
                }
            }
            out.put("prepared_counts", counts);

            try (Statement s = c.createStatement()) {
                s.executeUpdate("DELETE FROM gpu_samples WHERE gpu_uuid = '" + gpu + "'");
                out.put("write", "accepted");
            } catch (SQLException e) {
                out.put("write", e.getSQLState());
            }

            // A cursor read two rows at a time, as DBeaver's result viewer does.
            c.setAutoCommit(false);
            try (PreparedStatement ps = c.prepareStatement(
                    "SELECT gpu_uuid, time FROM gpu_samples WHERE window_s > ? ORDER BY time, gpu_uuid LIMIT 7")) {
                ps.setFetchSize(2);
                ps.setDouble(1, 0.5);
                int n = 0;
                try (ResultSet rs = ps.executeQuery()) { while (rs.next()) n++; }
                out.put("fetched_in_pieces", n);
            }
            c.commit();
        }
        System.out.println(json(out));
    }

    static String json(Object v) {
        if (v instanceof Map) {
            StringBuilder b = new StringBuilder("{");
            for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
                if (b.length() > 1) b.append(',');
                b.append(json(e.getKey().toString())).append(':').append(json(e.getValue()));
            }
            return b.append('}').toString();
        }
        if (v instanceof List) {
            StringBuilder b = new StringBuilder("[");
            for (Object o : (List<?>) v) {
                if (b.length() > 1) b.append(',');
                b.append(json(o));
            }
            return b.append(']').toString();
        }
        if (v instanceof Number) return v.toString();
        StringBuilder b = new StringBuilder("\"");
        for (char ch : v.toString().toCharArray()) {
            if (ch == '"' || ch == '\\') b.append('\\').append(ch);
            else if (ch < 0x20) b.append(String.format("\\u%04x", (int) ch));
            else b.append(ch);
        }
        return b.append('"').toString();
    }
}
