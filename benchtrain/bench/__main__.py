from benchtrain.bench.cli import entry_point

entry_point()
