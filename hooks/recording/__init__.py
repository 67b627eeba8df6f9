"""The engine-agnostic recording side: what every engine adapter records through.

``recorder`` (tensors in, trace records out: the only owner of a trace writer) with ``config``
(what to record, as ``STATEDIFF_*`` variables), ``digest`` (summaries on the device) and ``keep``
(which tensors keep their data); ``faults`` (planted faults, one interface for every adapter);
``fields`` (what every adapter records alike: prompts, config and conversation digests,
acceptance); ``refocus`` (focused re-records); ``provenance`` (the stored command line). Only ``recorder`` and ``digest`` import torch,
and only when called.
"""
