"""Helpers that several test modules share: configs, the CLI in a subprocess, the
equivalence harness, collective recording, checkpoint states, pipeline settings.

A test module imports from here (and from meshtrain), never from another test module
(tests/test_layering.py checks it). The package is imported as `support`: tests/ is on
sys.path (tests/conftest.py, and pytest's own rootdir insertion), and the ranks that
meshtrain.testing.run_ranks forks inherit that sys.path, so a function defined here can
run on them.
"""
