"""Differential privacy: ``budgets.py`` (pure budget math), ``dp.py`` (local DP-SGD through
Opacus, per-client accountants), ``tracker.py`` (the server side: budgets sent with tasks, spend
recorded with replies, central DP)."""
