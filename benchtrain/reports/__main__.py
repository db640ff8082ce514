from benchtrain.reports.cli import entry_point

entry_point()
