"""Data read from files: resolving ``data.path`` into files and units, reading Parquet and delimited text (local or in an
object store, read ahead), and the streaming data modules ``data=parquet|csv|criteo`` with their configs."""
