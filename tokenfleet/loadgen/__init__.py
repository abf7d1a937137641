"""`tokenfleet bench`: a load generator for any Anthropic- or OpenAI-compatible endpoint, so
that tokenfleet and its peers (vLLM, llama.cpp's llama-server) are measured by one client.

    workload.py   which requests, when, how long, with which prompt (all from the seed)
    client.py     one streamed request, timed token by token
    batch_job.py  the batch class through the endpoint's own Batch API
    report.py     statistics, the table, bench.json and bench.png
    run.py        the orchestration: arrivals, the batch, the drain limit, progress
"""
