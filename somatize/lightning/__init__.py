"""somatize for Lightning: a strategy that honours a graph's placement, and a callback
that settles and caches what was declared frozen.

    trainer = lightning.Trainer(strategy=SomatizeStrategy(), callbacks=[SomatizeCache(store)])
"""

from ._callback import SomatizeCache
from ._derived import DerivedRNG
from ._strategy import SomatizeStrategy

__all__ = ["DerivedRNG", "SomatizeCache", "SomatizeStrategy"]
