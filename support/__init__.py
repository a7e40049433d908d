"""Test and benchmark support, not shipped: `pyproject.toml` packages only `src/`, and nothing under
`src/` imports this package (tests/unit/test_import_boundary.py checks). `tiny_models` builds the
tiny real checkpoints the tests and the benchmarks load (no model hub).

May import anything (mlx included).
"""

__all__ = [
    "tiny_models",
]
