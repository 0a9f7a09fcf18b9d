//! One query against a data directory, the way `apron sql --data DIR` will run it:
//!
//! ```text
//! cargo run -p apron-collector --example write_sample -- /tmp/apron-sample
//! cargo run -p apron-query --example sql -- /tmp/apron-sample "SELECT count(*) FROM gpu_samples" [table|json|csv]
//! ```

use std::io::Write;
use std::sync::Arc;

use apron_query::{DirectorySource, Format, QueryConfig, QueryEngine};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(dir), Some(sql)) = (args.next(), args.next()) else {
        return Err("usage: sql DATA_DIR SQL [table|json|csv]".into());
    };
    let format = match args.next() {
        Some(f) => Format::from_name(&f).ok_or("format: table, json, csv, arrow or parquet")?,
        None => Format::Table,
    };
    let engine = QueryEngine::new(QueryConfig::default(), Arc::new(DirectorySource::open(dir)?))?;
    match engine.execute(&sql).await {
        Ok(result) => {
            std::io::stdout().write_all(&result.render(format)?)?;
            Ok(())
        }
        Err(e) => {
            eprintln!("{}", e.to_json());
            std::process::exit(1);
        }
    }
}
