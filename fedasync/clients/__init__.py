"""The client side: ``runner.py`` (what a client does with one task, whatever the transport),
``app.py`` (the Flower ClientApp, in simulation and on a device) and ``warm.py`` (a device's warm
trainer: torch, data and model loaded once, a forked task process per message)."""
