"""The one compiled piece, kvstore.tiers._copyrows: the copy engine's block copy
(tiers/_copyrows.c) and the CPU arena's batch bookkeeping (tiers/_books.c).

Optional: where no C compiler is found the install goes on without it; the
copy engine then copies with ctypes.memmove and the arena runs its Python
loops (same results, slower on small blocks; ``kvstore.tiers.copy_engine.NATIVE``
and ``CpuArena.native`` say which a process uses).
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore.tiers._copyrows",
            sources=["tiers/_copyrows.c", "tiers/_books.c"],
            depends=["tiers/_books.h"],
            extra_compile_args=["-O2", "-std=c11"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
