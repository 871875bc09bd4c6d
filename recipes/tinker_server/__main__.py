"""``python -m recipes.tinker_server``: the old spelling of ``python -m tinker_server`` (deprecated,
removed after 2027-03-01: see ``recipes/tinker_server/__init__.py``)."""

from tinker_server.__main__ import main

if __name__ == "__main__":
    main()
