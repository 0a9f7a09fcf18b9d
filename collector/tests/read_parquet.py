#!/usr/bin/env python3
"""Opens the Parquet files of an Apron data directory with pyarrow and prints what a
reader sees: the schema, sort order, encodings, page index, and the Hive partitions.

Usage: python3 read_parquet.py DATA_DIR   (pip install pyarrow)
Exits non-zero if a file breaks the storage contract (types, sort metadata, encodings).
"""
import pathlib
import sys

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq


def check(cond, msg, errors):
    if not cond:
        errors.append(msg)


def main(root: pathlib.Path) -> int:
    errors = []
    for table in ("gpu_samples", "gpu_processes"):
        files = sorted((root / table).glob("date=*/*.parquet"))
        if not files:
            continue
        pf = pq.ParquetFile(files[0])
        md = pf.metadata
        print(f"== {table}: {len(files)} file(s); first: {files[0].relative_to(root)}")
        print(pf.schema_arrow)
        rg = md.row_group(0)
        print(f"rows={md.num_rows} row_groups={md.num_row_groups} created_by={md.created_by!r}")
        sorting = [(pf.schema_arrow.field(s.column_index).name, s.descending) for s in rg.sorting_columns]
        print(f"sorting_columns={sorting}")
        for i in range(rg.num_columns):
            c = rg.column(i)
            print(f"  {c.path_in_schema:28} {c.physical_type:8} {c.compression:5} "
                  f"{','.join(c.encodings):40} column_index={c.has_column_index} offset_index={c.has_offset_index}")
        schema = pf.schema_arrow
        check(schema.field("time").type == pa.timestamp("us", tz="UTC"), "time is not timestamp[us, UTC]", errors)
        check(all(not pa.types.is_unsigned_integer(f.type) for f in schema), "unsigned integer column", errors)
        check(sorting == [("gpu_uuid", False), ("time", False)], f"sorting columns {sorting}", errors)
        encodings = {rg.column(i).path_in_schema: rg.column(i).encodings for i in range(rg.num_columns)}
        check("DELTA_BINARY_PACKED" in encodings["time"], "time not delta-encoded", errors)
        check("RLE_DICTIONARY" in encodings["gpu_uuid"], "gpu_uuid not dictionary-encoded", errors)
        # Every column has an offset index; the columns queries select by (time and
        # identity) also a column index (page min/max). Measurements keep row-group
        # statistics only (collector/src/persist.rs).
        check(all(rg.column(i).has_offset_index for i in range(rg.num_columns)), "offset index missing", errors)
        check(all(rg.column(i).has_column_index for i in range(rg.num_columns)
                  if rg.column(i).path_in_schema in ("time", "gpu_uuid", "host", "gpu_index")),
              "column index missing on time or identity", errors)
        check(all(rg.column(i).is_stats_set for i in range(rg.num_columns)), "row-group statistics missing", errors)
        if table == "gpu_samples":
            check(schema.field("gpu_util").type == pa.decimal128(5, 4), "gpu_util type", errors)
            check(schema.field("power_watts").type == pa.decimal128(9, 3), "power_watts type", errors)
            check(schema.field("fb_used_bytes").type == pa.int64(), "fb_used_bytes type", errors)
        dataset = ds.dataset(root / table, format="parquet", partitioning="hive")
        t = dataset.to_table()
        print(f"dataset (hive partitions): {t.num_rows} rows, partition column: {dataset.schema.field('date')}")
        print(t.slice(0, 2).select(["time", "gpu_uuid"] + (["gpu_util", "power_watts"] if table == "gpu_samples" else ["pid", "sm_util"])).to_pylist())
    for e in errors:
        print("FAIL:", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(pathlib.Path(sys.argv[1])))
