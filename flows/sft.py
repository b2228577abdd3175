"""``python -m flows.sft --data DIR --init DIR``: supervised fine-tuning alone (flow in flows.train)."""

from flows.train import sft_flow  # noqa: F401

if __name__ == "__main__":
    from trex.cli import main

    main(["sft"])
