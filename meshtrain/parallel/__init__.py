"""Layouts as data: mesh spec, rules, plan; the DTensor runtime that executes a plan."""
