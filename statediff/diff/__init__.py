"""The comparison of a cache-hit trace against its cold trace: what ``compare`` and ``calibrate`` do.

Pairing by (request, position, layer, kind) into a frozen plan (``align``),
the tolerance policy (``tolerance``; calibrated noise: ``noise``), float64
metrics streamed over both tensors (``metrics``), root versus propagated
divergences (``diverge``), what a wrong tensor matches (``diagnose``),
outputs and logprobs (``outputs``), the result records (``result``), the
pipeline itself (``compare``), ``calibrate`` and the heatmap (``plot``).
Imports the trace format (``statediff.trace``) and the replay inputs
(``statediff.replay``), never the incident or CLI layers.
"""
