"""The NumPy reference backend."""
