"""The leaf library: typed configuration (``config``) and stage references (``refs``).

Every other layer may import it; it imports nothing of the project except the model-argument modules
(``trainer/models/<arch>/args.py``), which are leaves themselves. ``.importlinter`` enforces both.
"""
