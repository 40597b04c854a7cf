"""Pre-flight check of the data and model of a config: every bad input is one line naming its key.

``check_data(cfg)`` loads the federation exactly as the run will (cached per process, so the run
reuses it) and builds the model on it, so a missing path, a file without the label column, ragged
samples, a label outside the class range, a ``natural`` partition with fewer groups than clients or
a model that does not fit the data's shape stop the command (exit 2) before anything is written.
"""

from __future__ import annotations

from fedasync.config import Config, ConfigError


def check_data(cfg: Config):
    """The run's ``FederatedData``; :class:`ConfigError` (one line, starting with the key) if it cannot be built."""
    from fedasync.task.data import load_federated
    from fedasync.task.models import build_model

    try:
        fed = load_federated(cfg.data, cfg.seed)
        build_model(cfg.model, fed.input_shape, fed.num_classes)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(msg if msg.split(" ")[0].rstrip(":").startswith(("data.", "model.", "num_classes"))
                          else f"data: {msg}") from None
    return fed
