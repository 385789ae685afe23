"""Stage 2, pricing: every node of a joint graph gets its bytes and recompute cost, and the graph becomes a
solver problem.

``costs`` prices nodes (bytes, FLOPs, scratch, for the compiler that runs the plan); ``devices`` models device
memory (the CUDA caching allocator, cuBLAS workspaces); ``problem`` turns a priced joint graph into a
:class:`ckptc.pricing.problem.JointProblem`.
"""
