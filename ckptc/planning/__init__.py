"""Stage 3, planning: what the budget counts, and which plan a graph gets under it.

``account`` is the step account (the budget and everything it holds besides activations); ``planner`` is the
one place that calls a solver, a preset or the floor; ``policies`` say what each preset may keep; ``replan``
turns what a step showed into the next account.
"""
