"""Experiments with multi-head attention. ``heads``: the head-count sweep of seed 003
(``mha experiment heads``); ``tasks`` its synthetic data, ``model`` its small transformer,
``report`` its tables and plot."""
