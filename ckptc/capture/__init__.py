"""Stage 1, capture: a training call becomes an aten-level joint forward+backward graph.

``compiler`` is the ``torch.compile`` backend and AOTAutograd partitioner hook that receives each graph and
drives the later stages on it; ``rng`` captures and replays random ops' generator state; ``coverage`` says
what the graphs cover (graph breaks, recurrent modules); ``offline`` captures models built on ``meta`` or under
fake tensors.
"""
