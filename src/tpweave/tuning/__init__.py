from tpweave.tuning.table import SiteShape, StrategyTable, load_table, save_table, site_shapes, table_key

__all__ = ["SiteShape", "StrategyTable", "load_table", "save_table", "site_shapes", "table_key"]
