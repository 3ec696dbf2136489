"""Global placement, autoscaling and the latency map (to come).

Its seam today: the edge reads omnid's upstream address from its flags; the
scheduler will publish placements and node health that the edge and omnid watch.
"""
