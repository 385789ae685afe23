"""Stage 4, rewrite: a plan becomes forward and backward graphs that recompute what was dropped just before
backward needs it.

``rewriter`` builds the graphs from the schedule; ``unused_grads`` gives results nobody used no gradient
tensor; ``lean_backward`` keeps the backward no larger than eager's (in-place accumulation, gradients added
into the resident ``.grad``).
"""
