"""The one compiled piece, kvstore.tiers._copyrows: the copy engine's block copy
(tiers/_copyrows.c), block meta reads (tiers/_books.c) and the CPU arena's books (tiers/_slots.c).

Optional: where no C compiler is found the install goes on without it; the
copy engine then copies with ctypes.memmove and the store's arena keeps its
books in Python objects (PyCpuArena: same results, slower on small blocks;
``kvstore.tiers.copy_engine.NATIVE`` and ``kvstore.tiers.cpu_arena.NATIVE``
say which a process uses).
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore.tiers._copyrows",
            sources=["tiers/_copyrows.c", "tiers/_books.c", "tiers/_slots.c"],
            depends=["tiers/_books.h"],
            extra_compile_args=["-O2", "-std=c11"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
