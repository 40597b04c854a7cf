"""Differential privacy: budgets (:mod:`.budgets`), DP-SGD on clients (:mod:`.dp`), the server's
accounting (:mod:`.tracker`).

Noise is secret by default: every DP noise draw and every Poisson batch sample comes from OS
entropy, never from the task seed the server sends (see :mod:`.dp` and
``fedasync.server.strategies.CentralDP``). ``privacy.reproducible_noise: true`` derives them from
the run seed instead, for simulated research runs that must be bit-reproducible; a deployment
refuses it (:func:`check_deployable`).
"""

from __future__ import annotations

from fedasync.config import Config, ConfigError

REPRODUCIBLE_REFUSED = (
    "privacy.reproducible_noise: true derives the DP noise from the seed the server sends with each task, so "
    "the server (or anyone with the run's seed) could regenerate the noise and subtract it; a deployment "
    "refuses it (set it false: noise from OS entropy)"
)


def check_deployable(cfg: Config) -> None:
    """Raise :class:`ConfigError` (one line) when ``cfg`` must not run in a deployment.

    Called by ``fedasync server`` before anything starts (exit 2); the deployment's
    :class:`~fedasync.privacy.tracker.PrivacyTracker` and every device's ClientApp refuse the
    same setting again, so a server started another way cannot use it either.
    """
    if cfg.privacy.reproducible_noise:
        raise ConfigError(REPRODUCIBLE_REFUSED)
