"""The run monitor (``p2ptrain monitor``): a DHT-only peer that reads a run's signed records and serves a
live web page, a JSON API and Prometheus metrics.

* ``view.py``: pure. Folds successive snapshots of the run's verified records into what the page shows
  (peers and their roles, the link matrix, the plan, loss and step-time series, joins, leaves, re-plans,
  the sync mode and DiLoCo round, each peer's bytes sent per step and compute utilisation).
* ``metrics.py``: the Prometheus collector over a view.
* ``server.py``: the web server (aiohttp) and the loop that polls the DHT.
* ``tensorboard.py``: the run's progress as TensorBoard event files (``--tensorboard DIR``).
* ``static/``: the page itself, plain HTML, CSS and JavaScript served by the monitor (nothing from a CDN).
"""
