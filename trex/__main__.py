"""``python -m trex ...``: the same as the ``trex`` command."""

from trex.cli import main

main()
