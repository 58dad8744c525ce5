"""The chaos suite's parts (bench/chaos.py): processes, load, store counts, faults.

Everything runs as the real programs on loopback (``llmgw serve``,
``llmgw gateway``, ``llmgw agent`` with their engines as processes), so a
fault is a signal to a real process, never a call into the code under test.
"""
