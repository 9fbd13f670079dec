"""Training draft heads on a frozen target (``specray train METHOD``), beside the serving stack.

``base.py`` is the one home of the data (the target's greedy continuations, cached
features, a held-out split), the optimisation loop and tree fitting; each method's recipe
is a short file (``medusa.py``, ``eagle.py``, ``eagle3.py``, ``redrafter.py``) that its
``MethodSpec.recipe`` names (``recipes.py`` finds them). Nothing here imports Ray, and
nothing but the command line imports this folder.
"""
