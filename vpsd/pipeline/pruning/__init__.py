"""Pruning math: which video tokens the draft model sees. Pure tensors in, kept indices out.

No models, no I/O: the signals (attention rebuilt from cached queries/keys, visual embeddings, hidden
states) are measured elsewhere and handed in as tensors. Kept indices follow the contract in select.py.
`strategies.STRATEGIES` is the entry point the pipeline uses.
"""
