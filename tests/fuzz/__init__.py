"""Fuzz targets for llmgw's parsers and servers.

The tests run each briefly (test_fuzz.py); bench/fuzz.py runs them longer.
"""
