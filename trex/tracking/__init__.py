"""Experiment tracking as a plain library (no Prefect): MLflow runs with buffering (``runs``), the model
registry (``registry``), the champion/challenger rule (``champion``), figures (``plots``) and the local UI
servers (``ui``). Tasks, the CLI and the benchmarks use it; the training and evaluation libraries do not.
"""
