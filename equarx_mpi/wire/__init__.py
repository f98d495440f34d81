"""The wire formats: what every format offers (base.py), one class per wire
and the table from name to class (formats.py), the error-bounded mode's
per-block mix (mixed.py), and stochastic rounding's random streams
(streams.py).  The schedules never look inside a format."""
