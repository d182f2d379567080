"""``python -m radixserve.cli``: the ``radixserve`` command."""

from radixserve.cli import entry

entry()
