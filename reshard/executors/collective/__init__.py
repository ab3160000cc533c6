"""The collective transport: torch.distributed point-to-point rounds (gloo between CPU processes, NCCL between
GPUs) over a group of this process's world or one made over a store.

`executor` (CollectiveExecutor, execute_collective: the executor), `schedule` (the rounds: which op moves in which
bucket between which pair), `runners` (one round's sends, receives and local copies), `comm` (the group: a world
group or a StoreComm made over a rendezvous's store), `lanes` (parallel streams per peer pair), `connect` (the
lazy first connection of a pair). Imported only when the collective transport is opened.
"""
