"""The CUDA room: result codes, the runtime protocol and its adapters (one result checker), the
ledger of what this process holds registered, the executor, `Registration` and the paced,
progressive registration. May import `hicache.effects._interrupts`, `hicache.plan` and
`hicache.errors` only: nothing of host memory, bring-up or copies."""
