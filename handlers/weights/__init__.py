"""One copy of the weights read by several loads of a model in one process (the engine's lanes,
handlers/run/lanes.py): pack.py puts the kind's read-only weights (artifact/kinds: `held_weights`)
in one allocation per dtype, and each load reads them in place (`load(..., weights=...)`)."""
