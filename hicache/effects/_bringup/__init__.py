"""The bring-up room: the host-wide budget lock, what is faulted when, the one handle
(`HostPools`) and `bring_up`. May import every other room of `hicache.effects`; only the face
(`hicache.effects`) imports it."""
