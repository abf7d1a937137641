"""Helpers the benchmark scripts share, by concern (a script imports `common.<module>`:
scripts run as `python bench/<script>.py`, so bench/ is on sys.path).

    log          a timestamped progress line
    schemas      the JSON schemas of the constrained-decoding benchmarks
    results      tables, a run's JSON and PNG, the machine it ran on, CPU busyness
    server       free ports; `tokenfleet serve` and peer servers started, awaited, stopped
    fleet        `serve --replicas N` on a Ray instance of its own, awaited until all are ready
    calibration  the mixed-load calibration (decode step, prefill rate, capacity, targets)
    batch        the mixed-load benchmark's batch added straight to an engine
    stats        percentiles the tokenfleet.loadgen one does not cover
    timing       the median time of a callable

A benchmark script is never a library of another: what two scripts need lives here.
"""
