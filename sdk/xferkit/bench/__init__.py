"""``xferkit bench``: model-shaped handoffs through real Sessions in real processes.

``models`` (the presets), ``content`` (bytes anyone can recompute, checked per
request), ``rank`` (one rank process), ``handoff`` (the coordinator: ranks,
requests, records), ``raw`` (driver throughput and calibration), ``report``
(tables, JSON, plots) and ``cli`` (the command line).
"""
