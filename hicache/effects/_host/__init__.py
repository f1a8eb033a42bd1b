"""The host room: mapping and pre-fault, worker threads, NUMA placement, machine probes and the
host allocators behind the `HostAllocator` protocol. May import `hicache.effects._interrupts`
and `hicache.effects._cuda` (the ledger, the runtime's binding), never bring-up or copies."""
