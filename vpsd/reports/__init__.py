"""Reports about runs: what a run directory adds up to and how runs compare.

summary (results + speedup over an `ar` run), timeline (role lanes, latency breakdown, Chrome trace
export), acceptance (accepted tokens per round), bias (position bias of kept tokens), kept_log (the
kept-token log the pruner writes and bias reads), bench (every method on one manifest, one table).
They read what jobs wrote; nothing here runs a model, and the job machinery (vpsd.launch) needs none
of it to run a job.
"""
