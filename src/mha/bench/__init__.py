"""``mha bench``: mha's backends against the peers, side by side in one process.

:mod:`mha.bench.core` holds the harness and documents how to add a suite (a module
``mha.bench.<name>`` exposing ``cases(ctx)`` or ``run(ctx)``); :mod:`mha.bench.peaks` measures
this machine's limits; :mod:`mha.bench.peers` adapts the peer libraries (imported lazily);
:mod:`mha.bench.report` prints and writes the results; :mod:`mha.bench.attention` is the
attention suite.
"""

from mha.bench.core import SUITES, Case, Context, Impl, Row, Skip, measure

__all__ = ["SUITES", "Case", "Context", "Impl", "Row", "Skip", "measure"]
