"""Data shipped inside the installed package.

    models/default, models/default-draft   the embedded model pair (see models/TRAINING.md)
    presets/                                the bench presets: the repository's top-level configs/,
                                            mapped here by pyproject.toml at build time (absent in a
                                            source checkout, where bench.py reads configs/ itself)
"""
