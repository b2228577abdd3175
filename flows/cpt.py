"""``python -m flows.cpt --data DIR``: continual pre-training alone (flow defined in flows.train)."""

from flows.train import cpt_flow  # noqa: F401

if __name__ == "__main__":
    from trex.cli import main

    main(["cpt"])
