"""``python -m recipes.tinker_server``: the old spelling of ``python -m tinker_server``."""

from tinker_server.__main__ import main

if __name__ == "__main__":
    main()
