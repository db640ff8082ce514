"""benchtrain inside your own Trainer: the callback, its guard and its run folder."""
