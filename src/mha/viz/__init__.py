"""Seeing inside: attention maps of a real model run through mha, as PNGs and one HTML page.

``attention_maps`` extracts the data, ``figures`` draws the PNGs, ``page`` writes the page.
"""
