"""Defaults of the comparison that the command line shows in its help.

Kept apart from the modules that use them (``noise``, ``compare``), which
import numpy: ``statediff --help`` imports only this.
"""

DEFAULT_FACTOR = 4.0  # compare --noise-factor: allowed multiple of the calibrated noise envelope
