"""The example, apart from the library: scikit-learn's digits (nothing downloaded), as a
plain LightningModule (``examples.digits``) and as a somatize graph
(``examples.digits_graph``). ``pip install somatize`` ships none of it.

    python train.py +somatize=split        # from the repository root: examples/ imports

How each process finds it: ``train.py`` sits at the repository root, so Python puts the
root on ``sys.path`` and Hydra's ``_target_: examples.digits.DigitsModel`` imports;
torchrun's ranks run that same script; a worker somatize starts on this machine gets
this process's ``sys.path`` as its ``PYTHONPATH``. A standing worker
(``python -m somatize.worker``) needs the root on its path only for classes sent by
reference, such as the graph route's ``Body`` node: start it from the repository root,
or with ``PYTHONPATH=/path/to/somatize``.
"""
