"""Keys' and teams' limits on the request path, held fleet-wide.

Each gateway worker process is one enforcement point: it counts what it
admits per key and team and enforces the share of each limit the control
plane lends it (llmgw.allowance has the scheme and its bound). ``check``
is the one hook the request path calls; ``point`` holds the counters and
talks to the control plane; ``windows`` counts over sliding minutes and
calendar periods.
"""
