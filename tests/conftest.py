"""Suite-wide settings: every Engine a test builds validates its step arrays against the block
manager before each step (`Engine(validate_tables=None)` reads this variable)."""

import os

os.environ.setdefault("PAGED_JAX_VALIDATE_TABLES", "1")
