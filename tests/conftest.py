import os
import sys

# Test modules import shared fixtures from each other (e.g. the equivalence config).
sys.path.insert(0, os.path.dirname(__file__))
