"""The graph route: a graph's training step (``Step``), driven by somatize's own
``Trainer``, by micro-batches in a 1F1B schedule (``Pipeline``), and by the Lightning
strategy for a ``GraphModule``; ``Split`` trains a node where it runs.

    from somatize.torch import Split, Trainer, GraphModule, parameters
"""
