"""The copy room: the copy engine, batched host copies (the optional C helper `_hostcopy`) and
`cudaMemcpyBatchAsync`. May import `hicache.effects._interrupts` and `hicache.effects._cuda`
(result codes), never host memory or bring-up."""
