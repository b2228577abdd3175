"""``python -m trex.cli ...``: the same as the ``trex`` command."""

from trex.cli import main

main()
