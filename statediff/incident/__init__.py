"""What an incident is made of, from one ``CompareResult``: the Markdown record (``record``), the
commands that reproduce it (``reproduce``), what a bundle keeps (``select``) and the bundle zip
itself (``bundle``: ``extract`` writes it, ``compare BUNDLE.zip`` and ``verify`` open it).

Nothing here compares twice, except the check that a written bundle reproduces the root.
"""
