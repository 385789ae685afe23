"""Stage 5, runtime: the planned step as users run it.

``step`` holds the per-shape plans of ``ckptc.optimize``, tracks and measures steps, and plans again in
place; ``watch`` is the same check for ``torch.compile(backend="ckptc")``; both follow a step's begin, end and
measured peak through ``tracker``; ``lengths`` buckets variable sequence lengths.
"""
