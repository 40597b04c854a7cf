"""The asynchronous server.

- ``loop.py``: :class:`~fedasync.server.loop.AsyncServer`, the loop itself (dispatch, take
  replies, validate, aggregate, record, evaluate).
- ``transport.py``: tasks and replies, the Transport protocol, the in-process LocalTransport.
- ``resume.py``: crash-safety state, resuming a stored run, which configs may continue it.
- ``records.py``: the store rows a reply leaves (untrusted fields coerced).
- ``control.py``: stopping (signals, the store's ``stopping`` status, no client left).
- ``progress.py``: liveness (no non-finite version is committed; a run that accepts nothing stops).
- ``summary.py``: a run's summary; ``evaluation.py``: the evaluation grid and time to target.
- ``strategies.py`` (with ``fedavg.py``, ``strategy_base.py``, ``central_dp.py``), ``staleness.py``, ``scheduler.py``, ``clock.py``, ``validation.py``: pure
  pieces (aggregation rules, staleness weights, client choice, clocks and speed profiles,
  update checks).
- ``app.py``: the Flower side (a Transport over Flower's Grid, the ServerApps).
"""
