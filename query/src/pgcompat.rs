//! What PostgreSQL clients expect of the catalog: `pg_catalog` (datafusion-pg-catalog's
//! tables and functions, per session: a team's describes its own catalog), and a
//! `version()` in PostgreSQL's form, which drivers parse on connect (SQLAlchemy, JDBC
//! and Grafana read the major version from it).

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
    ctx.register_udf(ScalarUDF::new_from_impl(JsonBuildObject {
        signature: Signature::variadic_any(Volatility::Immutable),
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

/// `json_build_object(k1, v1, …)`: a JSON object as text, from key/value pairs.
#[derive(Debug, PartialEq, Eq, Hash)]
struct JsonBuildObject {
    signature: Signature,
}

impl ScalarUDFImpl for JsonBuildObject {
    fn name(&self) -> &str {
        "json_build_object"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _args: &[DataType]) -> Result<DataType> {
        Ok(DataType::Utf8)
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        if !args.args.len().is_multiple_of(2) {
            return Err(DataFusionError::Plan("json_build_object takes key/value pairs".into()));
        }
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let mut out = Vec::with_capacity(args.number_rows);
        for row in 0..args.number_rows {
            let mut object = serde_json::Map::new();
            for pair in arrays.chunks(2) {
                let key = ScalarValue::try_from_array(&pair[0], row)?;
                let value = ScalarValue::try_from_array(&pair[1], row)?;
                object.insert(text_of(&key), json_of(&value));
            }
            out.push(serde_json::Value::Object(object).to_string());
        }
        Ok(ColumnarValue::Array(Arc::new(datafusion::arrow::array::StringArray::from(out))))
    }
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
