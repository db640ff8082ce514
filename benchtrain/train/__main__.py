from benchtrain.train.cli import entry_point

entry_point()
