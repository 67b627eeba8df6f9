"""``python -m statediff``: the same as the ``statediff`` console script."""

from .cli import main

if __name__ == "__main__":
    main()
