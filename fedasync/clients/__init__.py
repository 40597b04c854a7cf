"""The client side: ``runner.py`` (what a client does with one task, whatever the transport) and
``app.py`` (the Flower ClientApp, in simulation and on a device)."""
