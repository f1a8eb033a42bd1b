"""Build the optional native helper; everything else is declared in pyproject.toml.

`hicache.effects._hostcopy` (batched host block copies, see its source) is optional: where it
cannot be compiled the install goes on and hicache copies through ctypes memmove instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hicache.effects._hostcopy",
            sources=["hicache/effects/_hostcopy.c"],
            extra_compile_args=["-O2", "-std=c99"],
            optional=True,
        )
    ]
)
