//! What PostgreSQL clients expect of the catalog: `pg_catalog` (datafusion-pg-catalog's
//! tables and functions, per session: a team's describes its own catalog), and a
//! `version()` in PostgreSQL's form, which drivers parse on connect (SQLAlchemy, JDBC
//! and Grafana read the major version from it), the session parameters they read
//! (`SHOW x`, `current_setting('x')`), and the rewrites of client SQL that DataFusion
//! cannot plan as written: Grafana's search-path subquery, on the text
//! ([`rewrite_client_sql`]); catalog scalar subqueries and PostgreSQL type names in
//! `information_schema.columns`, on the parsed statement ([`rewrite_catalog_statement`]).

use std::borrow::Cow;
use std::sync::{Arc, Weak};

use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::catalog::{CatalogProvider, CatalogProviderList};
use datafusion::datasource::TableType;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::context::SessionContext;
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility, create_udf,
};
use datafusion::scalar::ScalarValue;
use datafusion_pg_catalog::pg_catalog::catalog_info::CatalogInfo;
use datafusion_pg_catalog::pg_catalog::context::EmptyContextProvider;
use datafusion_pg_catalog::pg_catalog::{PgCatalogSchemaProvider, PgCatalogStaticTables};

/// The PostgreSQL version the port speaks for (as pgwire's `server_version` says).
pub const PG_VERSION: &str = "16.6";

/// The session parameters clients read (`SHOW <name>`, `current_setting('<name>')`):
/// fixed, since a session cannot change anything that matters to a read-only engine.
/// Lower-case names; `transaction isolation level` is `SHOW`'s spelling.
pub const SETTINGS: &[(&str, &str)] = &[
    ("transaction isolation level", "read committed"),
    ("transaction_isolation", "read committed"),
    ("default_transaction_isolation", "read committed"),
    ("transaction_read_only", "on"),
    ("default_transaction_read_only", "on"),
    ("standard_conforming_strings", "on"),
    ("integer_datetimes", "on"),
    ("server_version", PG_VERSION),
    ("server_version_num", "160006"),
    ("client_encoding", "UTF8"),
    ("server_encoding", "UTF8"),
    ("search_path", SEARCH_PATH),
    ("datestyle", "ISO, MDY"),
    ("timezone", "UTC"),
    ("max_identifier_length", "63"),
    ("lc_collate", "en_US.UTF-8"),
    ("lc_ctype", "en_US.UTF-8"),
    ("application_name", ""),
];

/// The one schema Apron's tables live in, and so the whole search path.
pub const SEARCH_PATH: &str = "public";

/// A session parameter's value, by name in any case.
pub fn setting(name: &str) -> Option<&'static str> {
    let name = name.trim().to_ascii_lowercase();
    SETTINGS.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

/// `version()` as clients parse it: `PostgreSQL <major.minor> …`.
pub fn version_string() -> String {
    format!(
        "PostgreSQL {PG_VERSION} (Apron {}, Apache DataFusion {}), read-only",
        env!("CARGO_PKG_VERSION"),
        datafusion::DATAFUSION_VERSION
    )
}

/// Installs `pg_catalog` in `ctx`'s catalog `catalog`, its functions, and `version()`.
pub fn setup(ctx: &SessionContext, catalog: &str) -> Result<Arc<PgCatalogStaticTables>> {
    datafusion_pg_catalog::setup_pg_catalog(ctx, catalog, EmptyContextProvider).map_err(|e| *e)?;
    let tables = Arc::new(PgCatalogStaticTables::try_new()?);
    // In place of the schema `setup_pg_catalog` registered, which holds the catalogs
    // strongly.
    let catalogs = ctx.state().catalog_list().clone();
    let default = catalogs
        .catalog(catalog)
        .ok_or_else(|| DataFusionError::Plan(format!("no catalog {catalog} for pg_catalog")))?;
    register_for(&catalogs, default.as_ref(), tables.clone())?;
    let text = version_string();
    ctx.register_udf(create_udf(
        "version",
        vec![],
        DataType::Utf8,
        Volatility::Immutable,
        Arc::new(move |_| Ok(ColumnarValue::Scalar(ScalarValue::Utf8(Some(text.clone()))))),
    ));
    // Asked by schema browsers (SQLAlchemy's get_columns, DBeaver) about features
    // Apron's tables do not have: no serial sequences, every collation visible.
    ctx.register_udf(create_udf(
        "pg_get_serial_sequence",
        vec![DataType::Utf8, DataType::Utf8],
        DataType::Utf8,
        Volatility::Immutable,
        Arc::new(|_| Ok(ColumnarValue::Scalar(ScalarValue::Utf8(None)))),
    ));
    ctx.register_udf(create_udf(
        "pg_collation_is_visible",
        vec![DataType::Int32],
        DataType::Boolean,
        Volatility::Immutable,
        Arc::new(|_| Ok(ColumnarValue::Scalar(ScalarValue::Boolean(Some(true))))),
    ));
    // Grafana reads `current_setting('server_version_num')` to pick its SQL dialect.
    ctx.register_udf(ScalarUDF::new_from_impl(TextFunction {
        name: "current_setting",
        signature: Signature::one_of(
            vec![
                datafusion::logical_expr::TypeSignature::Exact(vec![DataType::Utf8]),
                datafusion::logical_expr::TypeSignature::Exact(vec![DataType::Utf8, DataType::Boolean]),
            ],
            Volatility::Stable,
        ),
        row: current_setting,
    }));
    ctx.register_udf(ScalarUDF::new_from_impl(TextFunction {
        name: PG_TYPE_NAME_FUNCTION,
        signature: Signature::exact(vec![DataType::Utf8], Volatility::Immutable),
        row: |args| Ok(args.first().filter(|a| !a.is_null()).map(|a| pg_type_name(&text_of(a)))),
    }));
    ctx.register_udf(ScalarUDF::new_from_impl(TextFunction {
        name: "json_build_object",
        signature: Signature::variadic_any(Volatility::Immutable),
        row: json_build_object,
    }));
    ctx.register_udf(create_udf(
        "to_regtype",
        vec![DataType::Utf8],
        DataType::Int32,
        Volatility::Immutable,
        Arc::new(to_regtype),
    ));
    Ok(tables)
}

/// A function of text, computed row by row from its arguments' values: the catalog
/// functions clients call that DataFusion lacks. Equal by name and signature (a name
/// is registered once).
#[derive(Debug)]
struct TextFunction {
    name: &'static str,
    signature: Signature,
    row: fn(&[ScalarValue]) -> Result<Option<String>>,
}

impl PartialEq for TextFunction {
    fn eq(&self, other: &Self) -> bool {
        (self.name, &self.signature) == (other.name, &other.signature)
    }
}

impl Eq for TextFunction {}

impl std::hash::Hash for TextFunction {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.name, &self.signature).hash(state);
    }
}

impl ScalarUDFImpl for TextFunction {
    fn name(&self) -> &str {
        self.name
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _args: &[DataType]) -> Result<DataType> {
        Ok(DataType::Utf8)
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let mut out = Vec::with_capacity(args.number_rows);
        for row in 0..args.number_rows {
            let values = arrays.iter().map(|a| ScalarValue::try_from_array(a, row)).collect::<Result<Vec<_>>>()?;
            out.push((self.row)(&values)?);
        }
        let values = datafusion::arrow::array::StringArray::from(out);
        if args.args.iter().all(|a| matches!(a, ColumnarValue::Scalar(_))) {
            return Ok(ColumnarValue::Scalar(ScalarValue::try_from_array(&values, 0)?));
        }
        Ok(ColumnarValue::Array(Arc::new(values)))
    }
}

/// `current_setting(name [, missing_ok])`: a [`SETTINGS`] value; an unknown name is
/// PostgreSQL's error, or NULL when `missing_ok`.
fn current_setting(args: &[ScalarValue]) -> Result<Option<String>> {
    let Some(name) = args.first().filter(|n| !n.is_null()) else {
        return Ok(None);
    };
    let name = text_of(name);
    let missing_ok = matches!(args.get(1), Some(ScalarValue::Boolean(Some(true))));
    match setting(&name) {
        Some(value) => Ok(Some(value.to_owned())),
        None if missing_ok => Ok(None),
        None => Err(DataFusionError::Execution(format!("unrecognized configuration parameter \"{name}\""))),
    }
}

/// The function [`rewrite_catalog_statement`] reads `information_schema.columns`'
/// `data_type` through.
const PG_TYPE_NAME_FUNCTION: &str = "apron_pg_type_name";

/// PostgreSQL's `information_schema` name of an Arrow type, given as DataFusion writes
/// it (`Utf8`, `Timestamp(µs, "UTC")`); a type PostgreSQL has no name for keeps its
/// Arrow name.
fn pg_type_name(arrow: &str) -> String {
    let Ok(data_type) = arrow.parse::<DataType>() else {
        return arrow.to_owned();
    };
    let value_type = match &data_type {
        DataType::Dictionary(_, value) => value.as_ref(),
        other => other,
    };
    match value_type {
        DataType::Boolean => "boolean",
        DataType::Int8 | DataType::Int16 | DataType::UInt8 => "smallint",
        DataType::Int32 | DataType::UInt16 => "integer",
        DataType::Int64 | DataType::UInt32 | DataType::UInt64 => "bigint",
        DataType::Float16 | DataType::Float32 => "real",
        DataType::Float64 => "double precision",
        DataType::Decimal32(..) | DataType::Decimal64(..) | DataType::Decimal128(..) | DataType::Decimal256(..) => {
            "numeric"
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "text",
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView | DataType::FixedSizeBinary(_) => "bytea",
        DataType::Date32 | DataType::Date64 => "date",
        DataType::Timestamp(_, Some(_)) => "timestamp with time zone",
        DataType::Timestamp(_, None) => "timestamp without time zone",
        DataType::Time32(_) | DataType::Time64(_) => "time without time zone",
        DataType::Interval(_) | DataType::Duration(_) => "interval",
        DataType::List(_) | DataType::LargeList(_) | DataType::FixedSizeList(..) | DataType::ListView(_) => "ARRAY",
        _ => return arrow.to_owned(),
    }
    .to_owned()
}

/// `information_schema.columns` as a PostgreSQL client reads it: DataFusion's, with
/// `data_type` in PostgreSQL's words (`text`, `timestamp with time zone`), which
/// Grafana's query builder and schema browsers type their column pickers by.
fn pg_information_schema_columns() -> Option<Box<datafusion::sql::sqlparser::ast::Query>> {
    use datafusion::sql::sqlparser::{ast::Statement, dialect::PostgreSqlDialect, parser::Parser};
    let sql = format!(
        "SELECT table_catalog, table_schema, table_name, column_name, ordinal_position, column_default, \
         is_nullable, {PG_TYPE_NAME_FUNCTION}(data_type) AS data_type, character_maximum_length, \
         character_octet_length, numeric_precision, numeric_precision_radix, numeric_scale, \
         datetime_precision, interval_type FROM information_schema.columns"
    );
    match Parser::parse_sql(&PostgreSqlDialect {}, &sql).ok()?.pop()? {
        Statement::Query(query) => Some(query),
        _ => None,
    }
}

/// `json_build_object(k1, v1, …)`: a JSON object as text, from key/value pairs.
fn json_build_object(args: &[ScalarValue]) -> Result<Option<String>> {
    if !args.len().is_multiple_of(2) {
        return Err(DataFusionError::Plan("json_build_object takes key/value pairs".into()));
    }
    let object: serde_json::Map<String, serde_json::Value> =
        args.chunks(2).map(|pair| (text_of(&pair[0]), json_of(&pair[1]))).collect();
    Ok(Some(serde_json::Value::Object(object).to_string()))
}

/// Grafana's "is this schema on the search path" subquery (its table and column
/// pickers send it), token for token. DataFusion cannot plan it (a function call in
/// `FROM`), and datafusion-pg-catalog's parser replaces it with `''`, which matches no
/// schema, so the column picker came back empty. Its value is a constant here: the
/// search path is [`SEARCH_PATH`]. Grafana sends it only as `x IN (<subquery>)`.
const GRAFANA_SEARCH_PATH_SUBQUERY: &str = r#"SELECT
    CASE WHEN trim(s[i]) = '"$user"' THEN user ELSE trim(s[i]) END
  FROM
    generate_series(
      array_lower(string_to_array(current_setting('search_path'),','),1),
      array_upper(string_to_array(current_setting('search_path'),','),1)
    ) as i,
    string_to_array(current_setting('search_path'),',') s"#;

/// Rewrites the parts of a PostgreSQL client's SQL that DataFusion cannot plan but
/// whose value is fixed here, before datafusion-pg-catalog's parser sees it: today
/// Grafana's search-path subquery, which becomes the literal `'<SEARCH_PATH>'` (so
/// `x IN (<subquery>)` reads `x IN ('public')`: DataFusion cannot plan an `IN`
/// subquery inside a `CASE` of the projection either). Matched on
/// tokens (whitespace and case of keywords aside), so a string literal that happens
/// to contain the text is left alone; anything else comes back unchanged.
pub fn rewrite_client_sql(sql: &str) -> Cow<'_, str> {
    use datafusion::sql::sqlparser::dialect::PostgreSqlDialect;
    use datafusion::sql::sqlparser::tokenizer::{Token, TokenWithSpan, Tokenizer};
    // Cheap test first: almost no query mentions it.
    if !sql.contains("current_setting") {
        return Cow::Borrowed(sql);
    }
    let dialect = PostgreSqlDialect {};
    let significant = |tokens: Vec<TokenWithSpan>| -> Vec<TokenWithSpan> {
        tokens.into_iter().filter(|t| !matches!(t.token, Token::Whitespace(_))).collect()
    };
    let (Ok(pattern), Ok(tokens)) = (
        Tokenizer::new(&dialect, GRAFANA_SEARCH_PATH_SUBQUERY).tokenize_with_location(),
        Tokenizer::new(&dialect, sql).tokenize_with_location(),
    ) else {
        return Cow::Borrowed(sql);
    };
    let (pattern, tokens) = (significant(pattern), significant(tokens));
    let same = |a: &Token, b: &Token| match (a, b) {
        (Token::Word(a), Token::Word(b)) => a.quote_style == b.quote_style && a.value.eq_ignore_ascii_case(&b.value),
        _ => a == b,
    };
    // Byte offset of a 1-based (line, column in characters) location.
    let line_starts: Vec<usize> = std::iter::once(0).chain(sql.match_indices('\n').map(|(i, _)| i + 1)).collect();
    let offset = |line: u64, column: u64| -> Option<usize> {
        let start = *line_starts.get(usize::try_from(line).ok()?.checked_sub(1)?)?;
        let column = usize::try_from(column).ok()?.checked_sub(1)?;
        sql[start..].char_indices().map(|(i, _)| start + i).chain(std::iter::once(sql.len())).nth(column)
    };
    let mut out = String::with_capacity(sql.len());
    let (mut copied, mut i) = (0, 0);
    while i + pattern.len() <= tokens.len() {
        let window = &tokens[i..i + pattern.len()];
        if !window.iter().zip(&pattern).all(|(t, p)| same(&t.token, &p.token)) {
            i += 1;
            continue;
        }
        let (first, last) = (&window[0].span, &window[pattern.len() - 1].span);
        let (Some(from), Some(to)) =
            (offset(first.start.line, first.start.column), offset(last.end.line, last.end.column))
        else {
            return Cow::Borrowed(sql);
        };
        out.push_str(&sql[copied..from]);
        out.push_str(&format!("'{SEARCH_PATH}'"));
        copied = to;
        i += pattern.len();
    }
    if copied == 0 {
        return Cow::Borrowed(sql);
    }
    out.push_str(&sql[copied..]);
    Cow::Owned(out)
}

/// Rewrites a PostgreSQL client's parsed statement where its catalog questions need
/// what DataFusion does not do: `information_schema.columns` is read through
/// [`pg_information_schema_columns`] (PostgreSQL's type names), and catalog scalar
/// subqueries are made plannable.
///
/// DataFusion decorrelates a
/// correlated scalar subquery only when it is aggregated ("must be aggregated to return
/// at most one row"), and schema browsers write them bare — SQLAlchemy's
/// `inspect().get_columns()` asks for each column's default, identity and collation so.
/// A subquery over `pg_catalog` tables alone that selects one plain expression (no
/// aggregate, no `GROUP BY`) selects `max(expr)` instead: the same value where there is
/// at most one row, which is what these lookups by OID have. Queries over Apron's
/// tables are left alone (there PostgreSQL's "more than one row" error stays an error).
///
/// DataFusion does not decorrelate a subquery in a `CASE` branch at all, and that is
/// where SQLAlchemy asks `pg_attrdef` and `pg_sequence`. Apron's tables have no column
/// defaults and no sequences, so those catalogs are empty and any subquery over them
/// alone is NULL: it is written so.
pub fn rewrite_catalog_statement(statement: &mut datafusion::sql::sqlparser::ast::Statement) {
    use datafusion::sql::sqlparser::ast::{Ident, TableAlias, TableFactor, VisitMut, VisitorMut};
    struct Columns;
    impl VisitorMut for Columns {
        type Break = ();
        // After the children, so the replacement's own `information_schema.columns` is
        // not visited again.
        fn post_visit_table_factor(&mut self, factor: &mut TableFactor) -> std::ops::ControlFlow<()> {
            if let TableFactor::Table { name, alias, args: None, .. } = factor {
                let parts: Vec<String> = name.0.iter().map(|p| p.to_string().to_ascii_lowercase()).collect();
                if parts.len() >= 2
                    && parts[parts.len() - 2..] == ["information_schema", "columns"]
                    && let Some(subquery) = pg_information_schema_columns()
                {
                    let alias = alias.take().unwrap_or_else(|| TableAlias {
                        explicit: true,
                        name: Ident::new("columns"),
                        columns: vec![],
                        at: None,
                    });
                    *factor = TableFactor::Derived { lateral: false, subquery, alias: Some(alias), sample: None };
                }
            }
            std::ops::ControlFlow::Continue(())
        }
    }
    let _ = statement.visit(&mut Columns);
    aggregate_catalog_subqueries(statement);
}

fn aggregate_catalog_subqueries(statement: &mut datafusion::sql::sqlparser::ast::Statement) {
    use datafusion::sql::sqlparser::ast::{
        Expr, Function, FunctionArg, FunctionArgExpr, FunctionArgumentList, FunctionArguments, GroupByExpr, ObjectName,
        SelectItem, SetExpr, TableFactor, visit_expressions_mut,
    };
    const AGGREGATES: &[&str] =
        &["max", "min", "count", "sum", "avg", "array_agg", "string_agg", "bool_and", "bool_or"];
    const EMPTY_CATALOGS: &[&str] = &["pg_attrdef", "pg_sequence"];
    // The catalog tables a FROM reads, or None when it reads anything else.
    let catalog_tables = |from: &[datafusion::sql::sqlparser::ast::TableWithJoins]| -> Option<Vec<String>> {
        let relations =
            from.iter().flat_map(|t| std::iter::once(&t.relation).chain(t.joins.iter().map(|j| &j.relation)));
        let tables = relations
            .map(|f| match f {
                TableFactor::Table { name, args: None, .. } => {
                    let parts: Vec<String> = name.0.iter().map(|p| p.to_string().to_ascii_lowercase()).collect();
                    match parts.as_slice() {
                        [table] if table.starts_with("pg_") => Some(table.clone()),
                        [schema, table] if schema == "pg_catalog" => Some(table.clone()),
                        _ => None,
                    }
                }
                _ => None,
            })
            .collect::<Option<Vec<String>>>()?;
        (!tables.is_empty()).then_some(tables)
    };
    let catalog_only = |from: &[datafusion::sql::sqlparser::ast::TableWithJoins]| catalog_tables(from).is_some();
    let _ = visit_expressions_mut(statement, |expr| {
        if let Expr::Subquery(query) = expr
            && let SetExpr::Select(select) = query.body.as_ref()
            && catalog_tables(&select.from).is_some_and(|t| t.iter().all(|t| EMPTY_CATALOGS.contains(&t.as_str())))
        {
            *expr = Expr::value(datafusion::sql::sqlparser::ast::Value::Null);
            return std::ops::ControlFlow::<()>::Continue(());
        }
        if let Expr::Subquery(query) = expr
            && let SetExpr::Select(select) = query.body.as_mut()
            && select.projection.len() == 1
            && matches!(&select.group_by, GroupByExpr::Expressions(e, _) if e.is_empty())
            && select.having.is_none()
            && catalog_only(&select.from)
        {
            let item = match &mut select.projection[0] {
                SelectItem::UnnamedExpr(e) | SelectItem::ExprWithAlias { expr: e, .. } => e,
                _ => return std::ops::ControlFlow::<()>::Continue(()),
            };
            let aggregated = matches!(item, Expr::Function(f)
                if AGGREGATES.contains(&f.name.to_string().to_ascii_lowercase().trim_start_matches("pg_catalog.")));
            if !aggregated {
                let inner = std::mem::replace(item, Expr::value(datafusion::sql::sqlparser::ast::Value::Null));
                *item = Expr::Function(Function {
                    name: ObjectName::from(vec![datafusion::sql::sqlparser::ast::Ident::new("max")]),
                    uses_odbc_syntax: false,
                    parameters: FunctionArguments::None,
                    args: FunctionArguments::List(FunctionArgumentList {
                        duplicate_treatment: None,
                        args: vec![FunctionArg::Unnamed(FunctionArgExpr::Expr(inner))],
                        clauses: vec![],
                    }),
                    filter: None,
                    null_treatment: None,
                    over: None,
                    within_group: vec![],
                });
            }
        }
        std::ops::ControlFlow::Continue(())
    });
}

fn text_of(v: &ScalarValue) -> String {
    match v {
        ScalarValue::Utf8(Some(s)) | ScalarValue::LargeUtf8(Some(s)) | ScalarValue::Utf8View(Some(s)) => s.clone(),
        other => other.to_string(),
    }
}

fn json_of(v: &ScalarValue) -> serde_json::Value {
    if v.is_null() {
        return serde_json::Value::Null;
    }
    match v {
        ScalarValue::Boolean(Some(b)) => serde_json::Value::Bool(*b),
        ScalarValue::Int8(_)
        | ScalarValue::Int16(_)
        | ScalarValue::Int32(_)
        | ScalarValue::Int64(_)
        | ScalarValue::UInt8(_)
        | ScalarValue::UInt16(_)
        | ScalarValue::UInt32(_)
        | ScalarValue::UInt64(_)
        | ScalarValue::Float32(_)
        | ScalarValue::Float64(_) => {
            serde_json::from_str(&v.to_string()).unwrap_or_else(|_| serde_json::Value::String(v.to_string()))
        }
        other => serde_json::Value::String(text_of(other)),
    }
}

/// Built-in types by name and OID (PostgreSQL's fixed OIDs), for `to_regtype`.
const TYPES: [(&str, i32); 18] = [
    ("bool", 16),
    ("bytea", 17),
    ("int8", 20),
    ("int2", 21),
    ("int4", 23),
    ("text", 25),
    ("oid", 26),
    ("json", 114),
    ("float4", 700),
    ("float8", 701),
    ("varchar", 1043),
    ("date", 1082),
    ("time", 1083),
    ("timestamp", 1114),
    ("timestamptz", 1184),
    ("interval", 1186),
    ("numeric", 1700),
    ("uuid", 2950),
];

/// `to_regtype(name)`: a built-in type's OID, NULL for any other (drivers probe for
/// extension types such as `hstore` on connect and take NULL as "not installed").
fn to_regtype(args: &[ColumnarValue]) -> Result<ColumnarValue> {
    let oid = |name: Option<&str>| {
        let name = name?.trim().trim_start_matches("pg_catalog.").to_ascii_lowercase();
        TYPES.iter().find(|(n, _)| *n == name).map(|(_, o)| *o)
    };
    match args.first() {
        Some(ColumnarValue::Scalar(s)) => {
            let name = match s {
                ScalarValue::Utf8(v) | ScalarValue::LargeUtf8(v) | ScalarValue::Utf8View(v) => v.as_deref(),
                _ => None,
            };
            Ok(ColumnarValue::Scalar(ScalarValue::Int32(oid(name))))
        }
        Some(ColumnarValue::Array(a)) => {
            let names = datafusion::arrow::compute::cast(a, &DataType::Utf8)?;
            let names = datafusion::arrow::array::AsArray::as_string::<i32>(&names);
            let oids: datafusion::arrow::array::Int32Array = names.iter().map(oid).collect();
            Ok(ColumnarValue::Array(Arc::new(oids)))
        }
        None => Err(DataFusionError::Plan("to_regtype takes one argument".into())),
    }
}

/// A `pg_catalog` schema describing `catalogs`, registered in `catalog` (one of them:
/// the session's default catalog, in place of the one `setup_pg_catalog` made for the
/// base session, and each team's own catalog in its session).
pub fn register_for(
    catalogs: &Arc<dyn CatalogProviderList>,
    catalog: &dyn CatalogProvider,
    tables: Arc<PgCatalogStaticTables>,
) -> Result<()> {
    let pg = PgCatalogSchemaProvider::try_new(Catalogs(Arc::downgrade(catalogs)), tables, EmptyContextProvider)?;
    catalog
        .register_schema("pg_catalog", Arc::new(pg))
        .map(|_| ())
        .map_err(|e| DataFusionError::Plan(format!("registering pg_catalog: {e}")))
}

/// The catalogs `pg_catalog` describes, held weakly: the schema lives inside one of
/// them, and a strong reference would be a cycle that keeps every table (and the store
/// under them) alive after the engine is dropped.
#[derive(Clone, Debug)]
struct Catalogs(Weak<dyn CatalogProviderList>);

impl Catalogs {
    fn get(&self) -> Result<Arc<dyn CatalogProviderList>> {
        self.0.upgrade().ok_or_else(|| DataFusionError::Internal("the session's catalogs are gone".into()))
    }
}

#[async_trait::async_trait]
impl CatalogInfo for Catalogs {
    async fn catalog_names(&self) -> Result<Vec<String>> {
        CatalogInfo::catalog_names(&self.get()?).await
    }

    async fn schema_names(&self, catalog: &str) -> Result<Option<Vec<String>>> {
        CatalogInfo::schema_names(&self.get()?, catalog).await
    }

    async fn table_names(&self, catalog: &str, schema: &str) -> Result<Option<Vec<String>>> {
        CatalogInfo::table_names(&self.get()?, catalog, schema).await
    }

    async fn table_schema(&self, catalog: &str, schema: &str, table: &str) -> Result<Option<SchemaRef>> {
        CatalogInfo::table_schema(&self.get()?, catalog, schema, table).await
    }

    async fn table_type(&self, catalog: &str, schema: &str, table: &str) -> Result<Option<TableType>> {
        CatalogInfo::table_type(&self.get()?, catalog, schema, table).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Grafana's table picker (postgresMetaQuery.ts `showTables()`): the subquery twice.
    const TABLES: &str = r#"SELECT
    CASE WHEN
          quote_ident(table_schema) IN (
          SELECT
            CASE WHEN trim(s[i]) = '"$user"' THEN user ELSE trim(s[i]) END
          FROM
            generate_series(
              array_lower(string_to_array(current_setting('search_path'),','),1),
              array_upper(string_to_array(current_setting('search_path'),','),1)
            ) as i,
            string_to_array(current_setting('search_path'),',') s
          )
      THEN quote_ident(table_name)
      ELSE quote_ident(table_schema) || '.' || quote_ident(table_name)
    END AS "table"
    FROM information_schema.tables
    ORDER BY CASE WHEN quote_ident(table_schema) IN (SELECT CASE WHEN trim(s[i]) = '"$user"' THEN user ELSE trim(s[i]) END FROM generate_series(array_lower(string_to_array(current_setting('search_path'),','),1), array_upper(string_to_array(current_setting('search_path'),','),1)) as i, string_to_array(current_setting('search_path'),',') s) THEN 0 ELSE 1 END, 1"#;

    #[test]
    fn grafanas_search_path_subquery_becomes_the_fixed_search_path_wherever_it_appears() {
        let out = rewrite_client_sql(TABLES);
        let expected = r#"SELECT
    CASE WHEN
          quote_ident(table_schema) IN (
          'public'
          )
      THEN quote_ident(table_name)
      ELSE quote_ident(table_schema) || '.' || quote_ident(table_name)
    END AS "table"
    FROM information_schema.tables
    ORDER BY CASE WHEN quote_ident(table_schema) IN ('public') THEN 0 ELSE 1 END, 1"#;
        assert_eq!(out, expected);
    }

    #[test]
    fn other_sql_is_left_alone_even_when_it_mentions_the_subquery_in_a_string() {
        for sql in [
            "SELECT current_setting('server_version_num')::int/100 AS version",
            "SELECT 'SELECT CASE WHEN trim(s[i]) = current_setting(''search_path'')' AS t",
            "SELECT count(*) FROM gpu_samples",
            "SELECT é, current_setting('search_path') FROM t -- ünïcode",
        ] {
            assert!(matches!(rewrite_client_sql(sql), Cow::Borrowed(s) if s == sql), "{sql}");
        }
    }

    fn aggregated(sql: &str) -> String {
        use datafusion::sql::sqlparser::{dialect::PostgreSqlDialect, parser::Parser};
        let mut statements = Parser::parse_sql(&PostgreSqlDialect {}, sql).expect("parses");
        rewrite_catalog_statement(&mut statements[0]);
        statements[0].to_string()
    }

    #[test]
    fn catalog_scalar_subqueries_are_aggregated_and_those_over_empty_catalogs_are_null() {
        assert_eq!(
            aggregated(
                "SELECT a.attname, (SELECT t.typcollation FROM pg_catalog.pg_type t WHERE t.oid = a.atttypid) AS c \
                 FROM pg_catalog.pg_attribute a"
            ),
            "SELECT a.attname, (SELECT max(t.typcollation) FROM pg_catalog.pg_type t WHERE t.oid = a.atttypid) AS c \
             FROM pg_catalog.pg_attribute a"
        );
        assert_eq!(
            aggregated(
                "SELECT CASE WHEN a.atthasdef THEN (SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d \
                 WHERE d.adrelid = a.attrelid) END FROM pg_catalog.pg_attribute a"
            ),
            "SELECT CASE WHEN a.atthasdef THEN NULL END FROM pg_catalog.pg_attribute a"
        );
        // Already aggregated, or over Apron's tables: unchanged.
        for sql in [
            "SELECT (SELECT count(*) FROM pg_catalog.pg_class c WHERE c.relnamespace = n.oid) FROM pg_catalog.pg_namespace AS n",
            "SELECT (SELECT s.gpu_util FROM gpu_samples AS s WHERE s.gpu_uuid = c.gpu_uuid) FROM gpu_cost_hourly AS c",
        ] {
            assert_eq!(aggregated(sql), sql);
        }
    }

    #[test]
    fn information_schema_columns_reads_postgresql_type_names_under_its_alias() {
        let sql =
            aggregated("SELECT c.column_name, c.data_type FROM information_schema.columns c WHERE c.table_name = 't'");
        assert!(
            sql.starts_with("SELECT c.column_name, c.data_type FROM (SELECT table_catalog, ")
                && sql.contains("apron_pg_type_name(data_type) AS data_type")
                && sql.ends_with("FROM information_schema.columns) c WHERE c.table_name = 't'"),
            "{sql}"
        );
        let sql = aggregated("SELECT data_type FROM datafusion.information_schema.columns");
        assert!(sql.ends_with("FROM information_schema.columns) AS columns"), "{sql}");
        // Other information_schema tables, and a table of ours called columns: unchanged.
        for sql in ["SELECT table_name FROM information_schema.tables", "SELECT * FROM columns"] {
            assert_eq!(aggregated(sql), sql);
        }
        for (arrow, pg) in [
            ("Utf8", "text"),
            ("Dictionary(Int32, Utf8)", "text"),
            ("Float64", "double precision"),
            ("Int32", "integer"),
            ("Int64", "bigint"),
            ("Boolean", "boolean"),
            ("Decimal128(5, 4)", "numeric"),
            (r#"Timestamp(µs, "UTC")"#, "timestamp with time zone"),
            ("Timestamp(ns)", "timestamp without time zone"),
            ("not a type", "not a type"),
        ] {
            assert_eq!(pg_type_name(arrow), pg, "{arrow}");
        }
    }

    #[test]
    fn settings_are_found_in_any_case_and_unknown_ones_are_not() {
        assert_eq!(setting("Search_Path"), Some("public"));
        assert_eq!(setting(" server_version_num "), Some("160006"));
        assert_eq!(setting("transaction isolation level"), Some("read committed"));
        assert_eq!(setting("work_mem"), None);
        assert!(version_string().starts_with(&format!("PostgreSQL {PG_VERSION} ")));
    }
}
