"""The layout half of parallelism, pure data: the named mesh, the rules from logical
axes to mesh axes, the plan they compile to (placements per parameter and activation)
and its console table. The runtime that executes a plan is meshtrain/parallel."""
