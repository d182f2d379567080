"""Settings whose values need more than a type check: their parsed forms and checks.
``ServerArgs`` (``radixserve/config.py``) is built on them; they import nothing of the package."""
