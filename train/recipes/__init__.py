"""The recipes that wire the rooms below into a command: the configuration from the command line,
the setup both share, the training recipe (train.recipes.recipe.TrainRecipe) and the comparison of
calibrations."""
