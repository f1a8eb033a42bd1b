"""Drop-in replacements for other projects' registration helpers (see hicache.compat.sglang)."""
