"""Build the optional native helpers; everything else is declared in pyproject.toml.

`hicache.effects._copy._hostcopy` (batched host block copies) and `hicache.pools._pagestack` (the page
allocator's alloc/free) are optional: where they cannot be compiled the install goes on and
hicache copies through ctypes memmove / allocates pages with torch operations instead.
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
            "hicache.pools._pagestack",
            sources=["hicache/pools/_pagestack.c"],
            extra_compile_args=["-O2", "-std=c99"],
            optional=True,
        ),
    ]
)
