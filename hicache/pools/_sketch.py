"""A pool's geometry without the pool (issue #55 item 1: `HostKVCache.geometry_of` and
`from_geometry`): `sketch` runs a pool class's own constructor - SGLang's signature, its form
told apart and bound once - up to the moment its `PoolGeometry` is made, and hands that value back
instead of bringing anything up; `adoption` checks a geometry and a constructor's options for a
class to adopt it, before any memory. Imports the geometry, the form table and the options.
"""

from __future__ import annotations

import functools

from hicache.errors import LayoutError
from hicache.pools._forms import forms_of
from hicache.pools._geometry import PoolGeometry, check_layout
from hicache.pools._options import check_dummy, split_keywords


class _Made(BaseException):
    """Carries a sketched pool's geometry out of its constructor (a BaseException, so no
    family's ``except Exception`` can take it for a failure)."""

    def __init__(self, geometry: PoolGeometry) -> None:
        super().__init__()
        self.geometry = geometry


class _Sketch:
    """Mixed in before a pool class: its constructor stops where the pool would come up."""

    def _come_up(self, geometry, options, host_setup) -> None:
        raise _Made(geometry)


@functools.cache
def _sketch_class(cls: type) -> type:
    """``cls`` under its own name, whose constructor makes the geometry and stops."""
    return type(cls)(cls.__name__, (_Sketch, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def sketch(cls: type, args: tuple, kwargs: dict) -> PoolGeometry:
    """The geometry ``cls(*args, **kwargs)`` would adopt: the same checks and errors, no memory."""
    try:
        _sketch_class(cls)(*args, **kwargs)
    except _Made as made:
        return made.geometry
    raise TypeError(f"{cls.__name__}'s constructor made no geometry")  # a family that never calls _build


def check_adoptable(cls: type, geometry) -> None:
    """``geometry`` is a `PoolGeometry` made for ``cls`` (its name and one of its forms): a
    geometry of another family would bring up buffers this class cannot read."""
    if not isinstance(geometry, PoolGeometry):
        raise TypeError(f"{cls.__name__}.from_geometry() takes a hicache.pools.PoolGeometry, got "
                        f"{type(geometry).__name__}")
    if geometry.owner != cls.__name__ or geometry.form not in forms_of(cls.pool_family):
        raise LayoutError(f"{cls.__name__}.from_geometry(): the geometry was made for {geometry.owner} "
                          f"({geometry.form.name} form), not {cls.__name__}")


def adoption(cls: type, geometry, keywords: dict):
    """(options, host setup) of ``cls.from_geometry(geometry, **keywords)``, every check first:
    the geometry is the class's, the options are the constructor's (SGLang's, ``options``,
    ``host``), ``is_dummy`` suits its form (None: as the form says), and its layout suits the
    server's io backend."""
    name = cls.__name__
    check_adoptable(cls, geometry)
    if keywords.get("is_dummy") is None:  # as its form says: an allocator-only form's pools hold no memory
        keywords = dict(keywords, is_dummy=geometry.form.allocator_only)
    elif geometry.form.allocator_only and not keywords["is_dummy"]:
        raise LayoutError(f"{name}.from_geometry(): is_dummy={keywords['is_dummy']!r}, but the {geometry.form.name} "
                          "form's pools hold no memory (is_dummy=True)")
    _, settings = split_keywords(name, keywords)
    check_dummy(name, geometry.form, settings)
    host_setup = settings.host_setup(name, cls.default_host)
    check_layout(name, geometry.layout, geometry.shape.descriptor_class.supported(), host_setup.server)
    return settings, host_setup
