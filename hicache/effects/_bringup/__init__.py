"""The bring-up room: the host-wide budget lock, what is faulted when, the one handle
(`HostPools`), `bring_up`, and an admission check held under the lock until its memory is
resident (`_admission`, what the SGLang plug-in wraps SGLang's check with). May import every other room of `hicache.effects`; only the face
(`hicache.effects`) imports it."""
