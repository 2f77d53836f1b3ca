"""The placed route: a submodule placed on a worker by name and called as the model's
code calls it. Cut along where it runs: here (``_here.py``: the module's stand-in, its
call and backward; ``_routing.py``: where the module's calls go), there (``_there.py``:
what the worker runs), what travels between (``_messages.py``: a ``Call`` and its
``Answer``; ``_module_ops.py``: what the worker is sent of the module itself). The
optimizers over there that follow the ones here are shared with the graph route
(``somatize/torch/_mirror.py``, ``_mirror_ops.py``).

    SomatizeStrategy(place={"encoder": "worker"})     # somatize.lightning drives it
"""
