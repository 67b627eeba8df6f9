"""What runs the engine side for a purpose: ablation tables of hit/cold pairs (``ablate``), boundary
sweeps sized for an engine (``sweep``), and the built-in agent conversation (``demo``)."""
