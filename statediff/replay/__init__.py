"""What the engine side replays and how a run is accounted for, as pure data (no engine, no trace I/O).

Conversation files (``conversation``), boundary sweeps (``sweep``), split
plans of the exact replay (``splitplan``), the prefix-cache hit each
request could get (``hits``), the ``statediff record`` line that reproduces
a run (``command``) and the focus of a re-record (``focus``).
"""
