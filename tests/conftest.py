import os
import sys

# tests import helpers (tiny_models) from this folder
sys.path.insert(0, os.path.dirname(__file__))
