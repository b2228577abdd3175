"""The ``trex`` command line: the top layer. It parses the configuration once and calls flows and libraries."""

from trex.cli.main import app, main

__all__ = ["app", "main"]
