"""Build the optional native helpers; everything else is declared in pyproject.toml.

`hicache.effects._copy._hostcopy` (batched host block copies), `hicache.pools._pagestack` (the page
allocator's alloc/free) and `hicache.effects._arena._slotops` (the node store's atomics and
checksumming copies) are optional: where they cannot be compiled the install goes on and
hicache copies through ctypes memmove / allocates pages with torch operations / runs the store's
slot protocol on ctypes loads and stores and torch sums instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hicache.effects._copy._hostcopy",
            sources=["hicache/effects/_copy/_hostcopy.c"],
            extra_compile_args=["-O2", "-std=c99"],
            optional=True,
        ),
        Extension(
            "hicache.effects._arena._slotops",
            sources=["hicache/effects/_arena/_slotops.c"],
            extra_compile_args=["-O3", "-std=gnu99"],  # -O3: the checksum's lanes vectorize
            optional=True,
        ),
        Extension(
            "hicache.pools._pagestack",
            sources=["hicache/pools/_pagestack.c"],
            extra_compile_args=["-O2", "-std=c99"],
            optional=True,
        ),
    ]
)
