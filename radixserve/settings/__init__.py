"""Settings whose values need more than a type check: their parsed forms and checks.
``ServerArgs`` (``radixserve/config.py``) is built on them, and ``checks.py`` holds its checks;
they import nothing of the package outside ``settings/``."""
