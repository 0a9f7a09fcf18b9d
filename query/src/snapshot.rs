//! [`SnapshotTable`]: a table whose rows the server replaces wholesale (the `alerts` and
//! `recommendations` tables, which the query layer's own evaluators produce rather than
//! the collector stores). A scan reads the rows current when it starts; a replacement
//! never changes a scan already running.

use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::{MemTable, Session, TableProvider};
use datafusion::error::Result;
use datafusion::logical_expr::{Expr, TableType};
use datafusion::physical_plan::ExecutionPlan;

/// Rows held in memory, replaced as a whole.
#[derive(Debug)]
pub struct SnapshotTable {
    schema: SchemaRef,
    batches: RwLock<Arc<Vec<RecordBatch>>>,
}

impl SnapshotTable {
    /// An empty table of `schema`.
    pub fn new(schema: SchemaRef) -> Arc<SnapshotTable> {
        Arc::new(SnapshotTable { schema, batches: RwLock::new(Arc::new(Vec::new())) })
    }

    /// Replaces every row. Batches must have the table's schema.
    pub fn replace(&self, batches: Vec<RecordBatch>) {
        *self.batches.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(batches);
    }

    fn current(&self) -> Arc<Vec<RecordBatch>> {
        self.batches.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

#[async_trait]
impl TableProvider for SnapshotTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let rows = self.current();
        MemTable::try_new(self.schema.clone(), vec![rows.as_ref().clone()])?
            .scan(state, projection, filters, limit)
            .await
    }
}
