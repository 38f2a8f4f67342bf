"""Every drafter of the engine, one module each, behind one protocol (protocol.py `Drafter`):

    local.py      LocalDrafter: the draft model in the target's process, taking turns with it (a chain)
    tree.py       TreeDrafter: a static draft tree in the target's process (sd-tree, specvlm)
    sparse_kv.py  SparseKVDrafter: the target's own weights on a sparse copy of its cache (Sparse-to-Dense)
    remote.py     RemoteDrafter: the draft and the pruner on their own ranks or threads, beside the target
    chain.py      the one batched chain step (bring every row in line, one forward) that the local drafters and
                  the draft role (roles/draft.py) share

What drafts on the draft's side (the draft model's batched cache, or TABED's views) is a proposer
(engine/proposers.py), whichever drafter drives it.
"""
