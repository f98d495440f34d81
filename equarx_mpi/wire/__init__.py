"""The wire formats: what every format offers (base.py), one class per wire
and the registry of wires, each declared once (formats.py: REGISTRY), the error-bounded mode's
per-block mix (mixed.py), stochastic rounding's random streams
(streams.py), a format's kernels over several threads (threaded.py) and
the two-shot owner's many-input reductions for formats without fused ones
(many.py).  The schedules never look inside a format."""
