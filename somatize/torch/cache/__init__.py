"""The cache: outputs of settled modules kept in a store under keys that name what they
were computed from (``freeze``, ``state_digest``), per batch (``_cached.py``) or per item
(``_per_item.py``).

    from somatize.torch import freeze, state_digest
"""
