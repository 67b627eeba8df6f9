"""The engine-side commands ``record``, ``build-tiny-model`` and ``ablate``: entry points of group
``statediff.commands`` (``pyproject.toml``), loaded only when invoked. Each parses its options,
calls one library function (``recording.make_recording``, ``tiny.catalog.build_tiny``,
``drivers.ablate.run_matrix``), prints and exits with the result's code."""
