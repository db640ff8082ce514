"""The recipes that wire the rooms below into a command: the configuration, the training recipe, the comparison of machines."""
