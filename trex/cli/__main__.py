"""``python -m trex.cli ...``: the same as the ``trex`` command."""

from trex.cli import main, start_with_allocator

start_with_allocator()
main()
