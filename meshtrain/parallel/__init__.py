"""The runtime half of parallelism: executes a plan (meshtrain/layout) with DTensors and
collectives: initialisation, the gather/reduce engine, context-parallel attention, the
expert exchange, overlap, keep-gathered stages."""
