"""Everything that sends messages: the quantized schedules, each declared
once (registry.py lists them, terms.py says what they declare; engine.py
runs ring.py, two_shot.py and rabenseifner.py on pieces cut by pieces.py;
hierarchical.py across nodes), the exact shared window (shm.py), MPI's
own collectives and the exact fix-up of flagged blocks (exact.py), where
the ranks are (nodes.py), the library's counting communicator
(counting.py) and its background threads: the ordered queue and the
waiting rule (background.py)."""
