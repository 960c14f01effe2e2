"""`python -m metrale_cli` runs the metrale command line."""

from .cli import main

if __name__ == "__main__":
    main()
