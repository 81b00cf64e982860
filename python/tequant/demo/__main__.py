"""`python -m tequant.demo`: runs tequant.demo.main (the package docstring says what it does;
flags: `python -m tequant.demo --help`). Tests: tests/test_demo.py.
"""
import sys

from . import main

sys.exit(main())
