"""What is decided in the caller's thread before a call runs: its options
(options.py), its buffers read and checked (buffers.py, validate.py), the
agreement that turns a local error into the same exception on every rank
(agree.py), the method (policy.py), where its error bound comes from
(bound_from.py), all of it put together per call (setup.py), what it
records (records.py), and the progress thread that runs
nonblocking and persistent calls (nonblocking.py).  Sends no data itself."""
